"""Items that hold the same values as another item (a file copied under a second name,
one recording in two groups, a file appended again under another name): named in the
report, a warning and ``zstore info``, and stored all the same."""

from __future__ import annotations

import importlib
import json
import shutil

import h5py
import numpy as np
import pytest
from conftest import cli, write_h5

import zstore
from zstore.convert._copies import item_digest

pipeline_module = importlib.import_module("zstore.convert.pipeline")

RATES = {"wav": 16000, "act": 100}


def _recording(seed: int, seconds: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "wav": (rng.integers(-3000, 3000, (1, 16000 * seconds)) / 32768).astype(np.float32),
        "act": (rng.random((2, 100 * seconds)) > 0.5).astype(np.float32),
    }


def _corpus(where, seconds: int):
    """a.h5 (u0, u1, and u2 holding u0's values again, written big-endian), b.h5 (u0, a
    recording of its own) and a copy of a.h5 under another name."""
    where.mkdir()
    a = {"u0": _recording(0, seconds), "u1": _recording(1, seconds)}
    write_h5(where / "a.h5", a)
    with h5py.File(where / "a.h5", "a") as f:
        for name, values in a["u0"].items():
            f.create_dataset(f"u2/{name}", data=values.astype(values.dtype.newbyteorder(">")))
    write_h5(where / "b.h5", {"u0": _recording(2, seconds)})
    shutil.copy(where / "a.h5", where / "a_copy.h5")
    return a


#: the corpus's copies, each with the earlier item (in source order) it copies
COPIES = [("a/u2", "a/u0"), ("a_copy/u0", "a/u0"), ("a_copy/u1", "a/u1"), ("a_copy/u2", "a/u0")]


@pytest.mark.parametrize("seconds", [3, 15])  # packed, and a group per item
def test_copies_are_named_and_stored_all_the_same(tmp_path, seconds):
    a = _corpus(tmp_path / "corpus", seconds)
    store = str(tmp_path / "s.zarr")
    with pytest.warns(UserWarning, match=r"4 item\(s\) hold the same values") as caught:
        report = zstore.convert(
            str(tmp_path / "corpus"), store, rates=RATES, workers=2, progress=False
        )
    assert (report.packed == 7) is (seconds == 3)
    assert sorted(report.copies) == COPIES
    assert "'a/u2' = 'a/u0'" in str(report) and "--exclude or items=" in str(report)
    assert any("copies of one recording?" in str(w.message) for w in caught)
    info = json.loads(cli("info", store, "--json").stdout)
    assert sorted(map(tuple, info["copies"])) == COPIES
    assert "4 item(s) hold the same values" in info["text"]
    ds = zstore.WindowDataset(store, window_seconds=None, cache=False)
    assert len(ds) == 7  # stored and read as items of their own
    got = {ds[i]["item"]: ds[i] for i in range(len(ds))}
    for item in ("a/u0", "a/u2", "a_copy/u2"):
        np.testing.assert_array_equal(got[item]["wav"].numpy(), a["u0"]["wav"])
    seen: dict[str, dict] = {}  # what an items= callable gets: no checksum in it
    zstore.WindowDataset(
        store,
        window_seconds=None,
        cache=False,
        items=lambda n, at: bool(seen.setdefault(n, at)) or True,
    )
    assert len(seen) == 7 and not any(k.startswith("zstore") for at in seen.values() for k in at)


def test_the_checksum_is_of_the_values_and_their_dtype():
    x = np.arange(12, dtype="<f4").reshape(3, 4)
    assert item_digest({"wav": x}) == item_digest({"wav": x.astype(">f4")})
    assert item_digest({"wav": x}) == item_digest({"wav": np.asfortranarray(x)})
    assert item_digest({"wav": x}) != item_digest({"wav": x.astype("<f8")})
    assert item_digest({"wav": x}) != item_digest({"wav": x.reshape(4, 3)})
    assert item_digest({"wav": x}) != item_digest({"mic": x})
    assert item_digest({"wav": x, "l": np.int64(1)}) != item_digest({"wav": x, "l": np.int64(2)})
    assert item_digest({"l": np.int64(1)}) != item_digest({"l": np.array([1])})
    # a large array's second half samples blocks; its first covers every byte: one value
    # changed outside the sampled blocks still makes another item
    big = np.random.default_rng(0).standard_normal((4, 160_000)).astype(np.float32)
    other = big.copy()
    other.flat[70_000] += 1  # byte 280,000: in the fifth 64 KiB block, not sampled
    assert item_digest({"wav": big}) != item_digest({"wav": other})
    assert item_digest({"wav": big}) == item_digest({"wav": big.copy()})


def test_an_append_names_new_items_that_copy_old_ones(tmp_path):
    write_h5(tmp_path / "a.h5", {"u0": _recording(0, 3), "u1": _recording(1, 3)})
    write_h5(tmp_path / "b.h5", {"v0": _recording(2, 3)})
    store = str(tmp_path / "s.zarr")
    zstore.convert([str(tmp_path / "a.h5"), str(tmp_path / "b.h5")], store, rates=RATES,
                   workers=1, progress=False)  # fmt: skip
    write_h5(tmp_path / "c.h5", {"w0": _recording(3, 3)})
    report = zstore.append(str(tmp_path / "c.h5"), store, workers=1, progress=False)
    assert report.copies == []
    shutil.copy(tmp_path / "a.h5", tmp_path / "dev.h5")
    write_h5(tmp_path / "d.h5", {"x0": _recording(4, 3), "x1": _recording(4, 3)})
    with pytest.warns(UserWarning, match=r"2 item\(s\) hold the same values"):
        report = zstore.append(str(tmp_path / "dev.h5"), store, workers=1, progress=False)
    assert sorted(report.copies) == [("dev/u0", "a/u0"), ("dev/u1", "a/u1")]
    with pytest.warns(UserWarning, match=r"1 item\(s\)"):
        report = zstore.append(str(tmp_path / "d.h5"), store, workers=1, progress=False)
    assert report.copies == [("d/x1", "d/x0")]  # a copy among the new items
    info = json.loads(cli("info", store, "--json").stdout)
    assert sorted(map(tuple, info["copies"])) == [
        ("d/x1", "d/x0"), ("dev/u0", "a/u0"), ("dev/u1", "a/u1"),
    ]  # fmt: skip
    assert len(zstore.WindowDataset(store, window_seconds=None, cache=False)) == 8


@pytest.mark.parametrize("seconds", [3, 15])
def test_a_resumed_conversion_keeps_the_checksums_written_before(tmp_path, monkeypatch, seconds):
    """A conversion killed once every item is written, before its manifest is published:
    the rerun writes nothing, and finds the checksums in the items' completion marks
    (or the packed batches' records)."""
    _corpus(tmp_path / "corpus", seconds)
    store = str(tmp_path / "s.zarr")
    options = {"rates": RATES, "workers": 1, "progress": False}

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline_module, "publish", killed)
    with pytest.raises(KeyboardInterrupt):
        zstore.convert(str(tmp_path / "corpus"), store, **options)
    monkeypatch.undo()
    with pytest.warns(UserWarning, match=r"4 item\(s\) hold the same values"):
        report = zstore.convert(str(tmp_path / "corpus"), store, **options)
    assert report.converted == 0 and report.already_done == 7
    assert sorted(report.copies) == COPIES
