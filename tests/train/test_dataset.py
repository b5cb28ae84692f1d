"""WindowDataset: windows, alignment, reproducibility, short items, DataLoader and DDP samplers."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
import zarr
from conftest import write_h5
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import zstore
from zstore.train._window_draw import draw_start


def test_item_layout_and_alignment(small_store, cache):
    ds = zstore.WindowDataset(small_store, window_seconds=2.0, cache=cache, short="skip")
    root = zarr.open_group(small_store, mode="r")
    for i in range(len(ds)):
        x = ds[i]
        assert set(x) == {"wav", "act", "item", "start", "length"}
        assert x["wav"].shape == (2, 32000) and x["act"].shape == (2, 200)
        assert x["wav"].dtype == torch.float32 and x["length"] == 200
        f = round(x["start"] * 100)
        assert abs(x["start"] * 100 - f) < 1e-9  # on the coarsest grid
        np.testing.assert_array_equal(x["act"].numpy(), root[x["item"]]["act"][:, f : f + 200])
        np.testing.assert_array_equal(
            x["wav"].numpy(), root[x["item"]]["wav"][:, 160 * f : 160 * (f + 200)]
        )


def test_draws_depend_on_seed_epoch_index_only(small_store, cache, tmp_path):
    a = zstore.WindowDataset(small_store, window_seconds=1.0, seed=3, cache=cache)
    b = zstore.WindowDataset(small_store, window_seconds=1.0, seed=3, cache=False)
    for i in reversed(range(len(a))):  # order does not matter
        assert a[i]["start"] == b[i]["start"]
        assert torch.equal(a[i]["wav"], b[i]["wav"])
    starts0 = [a[i]["start"] for i in range(len(a))]
    a.set_epoch(1)
    assert [a[i]["start"] for i in range(len(a))] != starts0
    a.set_epoch(0)
    assert [a[i]["start"] for i in range(len(a))] == starts0
    c = zstore.WindowDataset(small_store, window_seconds=1.0, seed=4, cache=False)
    assert [c[i]["start"] for i in range(len(c))] != starts0


def test_draw_start_is_uniform_enough():
    counts = np.bincount([draw_start(0, 0, i, 10) for i in range(10000)], minlength=10)
    assert counts.min() > 850 and counts.max() < 1150
    assert all(draw_start(s, e, i, 1) == 0 for s in range(3) for e in range(3) for i in range(3))


def _batches(ds, **kw):
    return [b for b in DataLoader(ds, batch_size=2, shuffle=False, **kw)]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_same_windows_with_any_worker_count_after_fork(small_store, cache, context):
    ds = zstore.WindowDataset(small_store, window_seconds=1.5, cache=cache, seed=9)
    ds.set_epoch(2)
    serial = _batches(ds)  # the parent opened and read the store first
    parallel = _batches(ds, num_workers=2, multiprocessing_context=context)
    assert len(serial) == len(parallel)
    for s, p in zip(serial, parallel):
        assert s["item"] == p["item"] and torch.equal(s["start"], p["start"])
        assert torch.equal(s["wav"], p["wav"]) and torch.equal(s["act"], p["act"])
    again = _batches(ds)  # and the parent still reads correctly afterwards
    assert all(torch.equal(s["wav"], a["wav"]) for s, a in zip(serial, again))


def test_pickles_small_and_reopens(small_store, cache):
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=cache)
    ds[0]
    blob = pickle.dumps(ds)
    assert len(blob) < 4000
    clone = pickle.loads(blob)
    assert len(clone) == len(ds) and torch.equal(clone[3]["wav"], ds[3]["wav"])


def test_whole_items(small_store):
    ds = zstore.WindowDataset(small_store, window_seconds=None, cache=False)
    root = zarr.open_group(small_store, mode="r")
    for i in range(len(ds)):
        x = ds[i]
        np.testing.assert_array_equal(x["wav"].numpy(), root[x["item"]]["wav"][...])
        assert x["start"] == 0 and x["length"] == root[x["item"]]["act"].shape[1]


def test_fields_and_transform(small_store):
    ds = zstore.WindowDataset(
        small_store,
        fields=["act"],
        window_seconds=1.0,
        cache=False,
        transform=lambda x: {**x, "act": x["act"].sum()},
    )
    x = ds[0]
    assert "wav" not in x and x["act"].ndim == 0
    with pytest.raises(zstore.ConfigError, match="no array"):
        zstore.WindowDataset(small_store, fields=["mel"], cache=False)


@pytest.fixture(scope="module")
def short_store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("short")
    rng = np.random.default_rng(0)
    frames = {"long": 500, "short": 120, "empty": 0}
    items = {
        k: {
            "wav": rng.standard_normal((1, n * 160)).astype(np.float32),
            "act": (rng.random((1, n)) > 0.5).astype(np.float32),
        }
        for k, n in frames.items()
    }
    src = write_h5(tmp / "s.h5", items)
    zstore.convert(src, tmp / "s.zarr", rates={"wav": 16000, "act": 100}, workers=1, progress=False)
    return str(tmp / "s.zarr"), items


def test_short_items_pad(short_store):
    url, items = short_store
    with pytest.warns(UserWarning, match="1 item.*padded") as said:
        ds = zstore.WindowDataset(url, window_seconds=2.0, short="pad", cache=False)
    assert any("'empty'" in str(w.message) and "no samples" in str(w.message) for w in said)
    assert len(ds) == 2 and ds.short_items == ["short"]  # a window of zeros only: not served
    by_name = {ds[i]["item"]: ds[i] for i in range(len(ds))}
    s = by_name["short"]
    assert s["wav"].shape == (1, 32000) and s["length"] == 120
    np.testing.assert_array_equal(s["wav"][:, :19200].numpy(), items["short"]["wav"])
    assert not s["wav"][:, 19200:].any() and not s["act"][:, 120:].any()
    batch = next(iter(DataLoader(ds, batch_size=3)))
    assert batch["wav"].shape == (2, 1, 32000) and sorted(batch["length"].tolist()) == [120, 200]


def test_short_items_skip_and_error(short_store):
    url, _ = short_store
    with pytest.warns(UserWarning, match="left out"):
        ds = zstore.WindowDataset(url, window_seconds=2.0, short="skip", cache=False)
    assert len(ds) == 1 and ds[0]["item"] == "long"
    with pytest.raises(zstore.ShortItemError, match="empty.*short|short.*empty"):
        zstore.WindowDataset(url, window_seconds=2.0, short="error", cache=False)
    with pytest.raises(zstore.ConfigError, match="short must be"):
        zstore.WindowDataset(url, window_seconds=2.0, short="truncate", cache=False)
    whole = zstore.WindowDataset(url, window_seconds=None, cache=False)
    assert {whole[i]["item"]: whole[i]["length"] for i in range(3)} == {
        "long": 500,
        "short": 120,
        "empty": 0,
    }


def test_distributed_sampler_shares(small_store, cache):
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=cache, seed=1)
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(1)
        ds.set_epoch(1)
        for batch in DataLoader(ds, batch_size=1, sampler=sampler):
            seen.append(batch["item"][0])
            i = ds._items.index(batch["item"][0])
            assert torch.equal(batch["wav"][0], ds[i]["wav"])
    assert sorted(seen) == sorted(ds._items)


def test_index_out_of_range(small_store):
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=False)
    with pytest.raises(IndexError):
        ds[len(ds)]


@pytest.mark.parametrize(
    "form",
    ["pickled list", "pickled tuple", "pickled set", "pickled array", "npy", "json", "text"],
)
def test_items_take_the_lists_users_already_have(small_store, tmp_path, form):
    import json
    import pickle

    names = ["utt000003", "utt000001"]
    path = tmp_path / "grp_list"
    if form == "pickled list":
        path.write_bytes(pickle.dumps(names))
    elif form == "pickled tuple":
        path.write_bytes(pickle.dumps(tuple(names), protocol=2))
    elif form == "pickled set":  # taken in sorted order: a set's own order varies
        path.write_bytes(pickle.dumps(set(names)))
        names = sorted(names)
    elif form == "pickled array":
        path.write_bytes(pickle.dumps(np.array(names)))
    elif form == "npy":
        with open(path, "wb") as f:
            np.save(f, np.array(names))  # np.save(path) would add ".npy" to the name
    elif form == "json":
        path.write_text(json.dumps(names))
    else:
        path.write_text("# the dev subset\nutt000003\n\nutt000001\n")
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=False, items=path)
    assert [ds[i]["item"] for i in range(len(ds))] == names


def test_item_lists_by_group_name_and_kaldi_style_lines(tmp_path):
    """A store of several files names items ``<file stem>/<group>``; lists users keep
    name the groups (``rec1``), or are Kaldi-style lines (``utt2spk``, ``wav.scp``:
    the name, then other columns). Each resolves when it means one item."""
    from conftest import corpus_files

    corpus_files(tmp_path)  # a.h5: rec0, rec1; b.hdf5: rec0; day2/c.h5: spk/rec9
    dst = tmp_path / "s.zarr"
    zstore.convert(tmp_path / "corpus", dst, rates={"wav": 16000}, workers=1, progress=False)
    path = tmp_path / "dev.txt"
    path.write_text("rec1 spk_a\nspk/rec9\nb/rec0 /data/b/rec0.wav\n")
    ds = zstore.WindowDataset(dst, window_seconds=1.0, cache=False, items=path)
    assert [ds[i]["item"] for i in range(len(ds))] == ["a/rec1", "c/spk/rec9", "b/rec0"]
    ds = zstore.WindowDataset(dst, window_seconds=1.0, cache=False, items=["rec1"])
    assert [ds[i]["item"] for i in range(len(ds))] == ["a/rec1"]
    with pytest.raises(zstore.ConfigError, match=r"'rec0' .*'a/rec0', 'b/rec0'"):
        zstore.WindowDataset(dst, window_seconds=1.0, cache=False, items=["rec0"])
    with pytest.raises(zstore.ConfigError, match="twice"):  # one item, two names
        zstore.WindowDataset(dst, window_seconds=1.0, cache=False, items=["rec1", "a/rec1"])
    with pytest.raises(zstore.ConfigError, match="not in the store: 'rec7'"):
        zstore.WindowDataset(dst, window_seconds=1.0, cache=False, items=["rec7"])
    # a name passed in a list is taken whole: only a text file's lines have columns
    with pytest.raises(zstore.ConfigError, match="not in the store: 'a/rec1 x'"):
        zstore.WindowDataset(dst, window_seconds=1.0, cache=False, items=["a/rec1 x"])


def test_an_item_list_from_the_home_directory(small_store, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "dev.txt").write_text("utt000002\n")
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=False, items="~/dev.txt")
    assert [ds[i]["item"] for i in range(len(ds))] == ["utt000002"]


@pytest.mark.parametrize(
    "content, words",
    [
        (b"\x80\x04garbage", "cannot read it as an item list"),
        (pickle.dumps({"a": 1}), "holds a dict"),
        (b"\xff\xfe\x00binary", "cannot read it as an item list"),
        (b'{"dev": ["utt000001"]}', "holds a JSON object"),
        (np.lib.format.magic(1, 0) + b"garbage", "cannot read it as an item list"),
    ],
)
def test_an_item_list_that_cannot_be_read_is_one_clear_error(small_store, tmp_path, content, words):
    path = tmp_path / "bad.pkl"
    path.write_bytes(content)
    with pytest.raises(zstore.ConfigError, match=words) as e:
        zstore.WindowDataset(small_store, window_seconds=1.0, cache=False, items=path)
    assert "bad.pkl" in str(e.value) and "pickled list, tuple, set or array" in str(e.value)


def test_an_items_covered_length_is_the_same_one_at_a_time():
    """An item's length (the frames every time array covers) is computed alone on each
    read, and for many items at once when a dataset opens: both give the same, with
    whole-number and other rate ratios."""
    from zstore.train._dataset_setup import ItemLengths

    rng = np.random.default_rng(3)
    frames = rng.integers(0, 5000, 400)
    lengths = {
        "act": frames,
        "wav": frames * 160 - rng.integers(0, 320, 400).clip(0, None),
        "emg": np.floor(frames * 2.56).astype(np.int64) - rng.integers(0, 3, 400),
    }
    rates = {"act": 100.0, "wav": 16000.0, "emg": 256.0}
    table = ItemLengths(lengths, rates, "act")
    together = table[np.arange(400)]
    assert [table[i] for i in range(400)] == together.tolist()
    assert isinstance(table[np.int64(7)], int)


@pytest.mark.parametrize("pack_seconds", [0.0, 10.0], ids=["own groups", "packed"])
def test_recordings_of_no_samples_are_not_padded(tmp_path, pack_seconds):
    # a failed segment: padded, its window was all zeros, served with the item's label
    rng = np.random.default_rng(1)
    items = {
        f"u{i}": {
            "wav": rng.standard_normal((1, 0 if i in (1, 4) else 16000 * (1 + i))).astype(
                np.float32
            ),
            "label": np.int64(i),
        }
        for i in range(5)
    }
    src = write_h5(tmp_path / "a.h5", items)
    store = tmp_path / "a.zarr"
    zstore.convert(src, store, rates={"wav": 16000}, progress=False, pack_seconds=pack_seconds)
    said = (
        r"2 item\(s\) hold no samples \(not one step of 'wav' at 16000/s, the coarsest "
        r"array read\) and are left out, not padded: 'u1', 'u4'"
    )
    with pytest.warns(UserWarning, match=said):
        ds = zstore.WindowDataset(store, window_seconds=1.5, fields=["wav", "label"])
    assert {ds[i]["item"] for i in range(len(ds))} == {"u0", "u2", "u3"}  # u0 padded
    assert ds.short_items == ["u0"]
    with pytest.warns(UserWarning, match="hold no samples"):
        listed = zstore.WindowDataset(store, window_seconds=0.5, fields=["wav"], items=["u4", "u3"])
    assert [listed[i]["item"] for i in range(len(listed))] == ["u3"]
    skip = zstore.WindowDataset(store, window_seconds=0.5, fields=["wav"], short="skip")
    assert {skip[i]["item"] for i in range(len(skip))} == {"u0", "u2", "u3"}
    with pytest.raises(zstore.ShortItemError, match="u1"):
        zstore.WindowDataset(store, window_seconds=0.5, fields=["wav"], short="error")
    whole = zstore.WindowDataset(store, window_seconds=None, fields=["wav", "label"])
    assert {whole[i]["item"]: whole[i]["wav"].shape[1] for i in range(len(whole))}["u4"] == 0


def test_a_recording_shorter_than_one_frame_is_named_with_its_frames(tmp_path):
    """100 samples of audio and no frame of labels at 100/s: no samples on the grid the
    windows are placed on, and the warning says which array's step that is."""
    rng = np.random.default_rng(2)
    items = {
        f"u{i}": {
            "wav": rng.standard_normal((1, 100 if i == 1 else 32000)).astype(np.float32),
            "act": rng.random((2, 0 if i == 1 else 200)).astype(np.float32),
        }
        for i in range(3)
    }
    src = write_h5(tmp_path / "a.h5", items)
    store = tmp_path / "a.zarr"
    zstore.convert(src, store, rates={"wav": 16000, "act": 100}, progress=False)
    said = r"1 item\(s\) hold no samples \(not one step of 'act' at 100/s.*: 'u1'"
    with pytest.warns(UserWarning, match=said):
        ds = zstore.WindowDataset(store, window_seconds=1.0)
    assert sorted(ds[i]["item"] for i in range(len(ds))) == ["u0", "u2"]
    audio = zstore.WindowDataset(store, window_seconds=0.001, fields=["wav"])
    assert sorted(audio[i]["item"] for i in range(len(audio))) == ["u0", "u1", "u2"]
