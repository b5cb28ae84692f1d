"""Item lists: train on a subset of a store's items, given as names, a file or a test."""

from __future__ import annotations

import pytest

import zstore


def names(ds) -> list[str]:
    return [ds[i]["item"] for i in range(len(ds))]


def test_a_list_of_names_in_its_order(small_store):
    ds = zstore.WindowDataset(
        small_store, window_seconds=1.0, cache=False, items=["utt000004", "utt000001"]
    )
    assert names(ds) == ["utt000004", "utt000001"]
    full = zstore.WindowDataset(small_store, window_seconds=1.0, cache=False)
    assert ds[0]["start"] == full[4]["start"]  # the same draw as in the full dataset


def test_a_file_of_names(small_store, tmp_path):
    listing = tmp_path / "train.txt"
    listing.write_text("# training items\nutt000002\n\nutt000005\n")
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=False, items=listing)
    assert names(ds) == ["utt000002", "utt000005"]


def test_a_callable_on_names_and_attributes(small_store):
    seen = {}

    def keep(name, attrs):
        seen[name] = attrs
        return name.endswith(("1", "3"))

    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=False, items=keep)
    assert names(ds) == ["utt000001", "utt000003"]
    assert seen["utt000001"].get("speaker_count") == 2  # the HDF5 group's attributes


def test_unknown_and_repeated_names_are_errors(small_store, tmp_path):
    with pytest.raises(zstore.ConfigError, match=r"2 item\(s\).*'nope'.*'utt9'"):
        zstore.WindowDataset(small_store, cache=False, items=["utt000001", "nope", "utt9"])
    with pytest.raises(zstore.ConfigError, match="twice"):
        zstore.WindowDataset(small_store, cache=False, items=["utt000001", "utt000001"])
    with pytest.raises(zstore.ConfigError, match="cannot read the item list"):
        zstore.WindowDataset(small_store, cache=False, items=tmp_path / "missing.txt")


def test_item_lists_survive_pickling_into_workers(small_store, cache):
    import pickle

    ds = zstore.WindowDataset(
        small_store, window_seconds=1.0, cache=cache, items=["utt000003", "utt000000"]
    )
    again = pickle.loads(pickle.dumps(ds))
    assert names(again) == ["utt000003", "utt000000"]


def test_time_first_arrays(tmp_path):
    import numpy as np
    from conftest import write_h5, zstore_cli

    rng = np.random.default_rng(0)
    items = {
        f"r{i}": {
            "wav": rng.standard_normal((n * 160, 2)).astype(np.float32),
            "act": (rng.random((3, n)) > 0.5).astype(np.float32),
        }
        for i, n in enumerate([500, 700])
    }
    src = write_h5(tmp_path / "t.h5", items)
    dst = tmp_path / "t.zarr"
    proc = zstore_cli(
        "convert", src, str(dst), "--rate", "wav=16000", "--time-axis", "wav=0", "--no-progress"
    )
    assert proc.returncode == 0, proc.stderr
    ds = zstore.WindowDataset(dst, window_seconds=2.0, cache=False)
    for epoch in range(3):
        ds.set_epoch(epoch)
        for i in range(len(ds)):
            out = ds[i]
            start = round(out["start"] * 100)
            assert out["wav"].shape == (32000, 2) and out["act"].shape == (3, 200)
            src_item = items[out["item"]]
            assert np.array_equal(
                out["wav"].numpy(), src_item["wav"][start * 160 : (start + 200) * 160]
            )
            assert np.array_equal(out["act"].numpy(), src_item["act"][:, start : start + 200])
    bad = zstore_cli(
        "convert", src, str(tmp_path / "b.zarr"), "--rate", "wav=16000", "--time-axis", "nope=0"
    )
    assert bad.returncode == 2 and "no array named 'nope'" in bad.stderr
    bad = zstore_cli(
        "convert", src, str(tmp_path / "c.zarr"), "--rate", "wav=16000", "--time-axis", "wav=2"
    )
    assert bad.returncode == 2 and "'wav' has 2 dimension(s)" in bad.stderr
