"""The format-2 manifest: a constant-size root header and a mapped item table; older
(format-1) stores keep opening and upgrade in place; the object writer equals zarr."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pytest
import zarr
from conftest import edit_header, manifest_of, write_h5, zstore_cli

import zstore
from zstore.errors import StoreFormatError
from zstore.format.objects import array_meta, encode_array

RATES = {"wav": 16000, "act": 100}


def many_items(tmp_path, n=300):
    rng = np.random.default_rng(7)
    items = {
        f"utt{i:05d}": {
            "wav": rng.standard_normal((1, 1600 + i % 150)).astype(np.float32),
            "act": (rng.random((2, 10)) > 0.5).astype(np.float32),
        }
        for i in range(n)
    }
    items["utt00003"]["meta"] = np.arange(3, dtype=np.int64)  # one item only
    write_h5(tmp_path / "many.h5", items)
    return items


def test_the_root_holds_no_per_item_metadata(tmp_path):
    data = many_items(tmp_path)
    dst = tmp_path / "s.zarr"
    zstore.convert(
        tmp_path / "many.h5",
        dst,
        rates=RATES,
        workers=2,
        progress=False,
        verify=True,
        pack_seconds=0,
    )
    root = json.loads((dst / "zarr.json").read_text())
    assert "consolidated_metadata" not in root
    assert len((dst / "zarr.json").read_bytes()) < 4000  # the same for 300 or 3 million items
    m = manifest_of(dst)
    assert len(m.items) == 300 and m.items[7] == "utt00007" and m.position("utt00299") == 299
    assert (
        list(m.items_with("meta")) == [3]
        and m.lengths["wav"][5] == 1605
        and m.lengths["wav"][250] == 1700
    )
    with pytest.raises(ValueError):
        m.position("nope")
    # zarr's own API reads the store: per-array metadata on demand
    group = zarr.open_group(dst, mode="r")
    np.testing.assert_array_equal(group["utt00003/meta"][...], data["utt00003"]["meta"])
    np.testing.assert_array_equal(group["utt00250/wav"][...], data["utt00250"]["wav"])
    ds = zstore.WindowDataset(dst, window_seconds=0.05, cache=False)
    got = ds[250]
    start = round(got["start"] * 16000)
    np.testing.assert_array_equal(
        got["wav"].numpy(), data["utt00250"]["wav"][:, start : start + 800]
    )


def test_a_damaged_item_table_is_an_error_naming_it(small_store, tmp_path):
    store = tmp_path / "s.zarr"
    shutil.copytree(small_store, store)
    table = next(store.glob("zstore_items_*")) / "c" / "0"
    raw = bytearray(table.read_bytes())
    raw[40] ^= 0xFF
    table.write_bytes(bytes(raw))
    with pytest.raises(StoreFormatError, match="item table.*checksum"):
        zstore.WindowDataset(store, cache=False)
    table.unlink()
    with pytest.raises(StoreFormatError, match="item table is missing"):
        zstore.WindowDataset(store, cache=False)


def test_a_worker_rechecks_a_table_changed_since_its_parent_checked_it(small_store, tmp_path):
    """A pickled dataset's workers skip re-reading the table its parent verified, but
    only while the file is the same (inode, size, modification time)."""
    store = tmp_path / "s.zarr"
    shutil.copytree(small_store, store)
    ds = zstore.WindowDataset(store, window_seconds=1.0, cache=False)
    state = pickle.dumps(ds)
    assert pickle.loads(state)[0]["item"] == ds[0]["item"]  # unchanged: opens
    table = next(store.glob("zstore_items_*")) / "c" / "0"
    before = table.stat().st_mtime_ns
    raw = bytearray(table.read_bytes())
    raw[40] ^= 0xFF
    with open(table, "r+b") as f:  # in place: the same inode and size
        f.write(raw)
    os.utime(table, ns=(before + 10**9, before + 10**9))
    with pytest.raises(StoreFormatError, match="item table.*checksum"):
        pickle.loads(state)


def _as_format_1(store) -> None:
    """Write the store's manifest as zstore 0.1 did: all of it in the root attribute,
    with zarr's consolidated metadata."""
    m = manifest_of(store)
    old = {
        "format": 1,
        "store_id": m.store_id,
        "arrays": {
            n: {"rate": a.rate, "time_axis": a.time_axis, "inferred": a.inferred}
            for n, a in m.arrays.items()
        },
        "items": list(m.items),
        "lengths": {n: v.tolist() for n, v in m.lengths.items()},
        "codec": m.codec,
        "chunk_seconds": m.chunk_seconds,
        "all_chunks_written": m.all_chunks_written,
        "present": {n: v.tolist() for n, v in m.present.items()},
        **m.extra,
    }
    shutil.rmtree(store / m.table)
    root = zarr.open_group(store, mode="r+", use_consolidated=False)
    root.attrs.put({"zstore": old})
    zarr.consolidate_metadata(str(store))


def test_format_1_stores_keep_opening_and_upgrade_in_place(small_store, tmp_path):
    reference = zstore.WindowDataset(small_store, window_seconds=1.0, seed=3, cache=False)
    store = tmp_path / "old.zarr"
    shutil.copytree(small_store, store)
    _as_format_1(store)
    old = zstore.WindowDataset(store, window_seconds=1.0, seed=3, cache=False)
    assert manifest_of(store).shapes is None and len(old) == len(reference)
    for i in range(len(old)):
        assert old[i]["item"] == reference[i]["item"]
        assert np.array_equal(old[i]["wav"].numpy(), reference[i]["wav"].numpy())
    chunks = {p: p.read_bytes() for p in store.rglob("c/*/*") if "zstore_items" not in str(p)}
    proc = zstore_cli("upgrade", str(store))
    assert proc.returncode == 0, proc.stderr
    assert "format 2" in proc.stdout
    new = manifest_of(store)
    assert new.shapes is not None and new.store_id == manifest_of(small_store).store_id
    assert "consolidated_metadata" not in json.loads((store / "zarr.json").read_text())
    assert all(p.read_bytes() == v for p, v in chunks.items())  # metadata only
    up = zstore.WindowDataset(store, window_seconds=1.0, seed=3, cache=False)
    assert all(
        np.array_equal(up[i]["wav"].numpy(), reference[i]["wav"].numpy()) for i in range(len(up))
    )
    again = zstore_cli("upgrade", str(store))
    assert again.returncode == 0 and "nothing to do" in again.stdout


def test_a_pickled_dataset_keeps_its_view_after_an_append(tmp_path):
    rng = np.random.default_rng(2)
    make = lambda: {"wav": rng.standard_normal((1, 32000)).astype(np.float32)}  # noqa: E731
    write_h5(tmp_path / "a.h5", {"r0": make(), "r1": make()})
    write_h5(tmp_path / "b.h5", {"r2": make()})
    dst = tmp_path / "s.zarr"
    zstore.convert(tmp_path / "a.h5", dst, rates={"wav": 16000}, workers=1, progress=False)
    ds = zstore.WindowDataset(dst, window_seconds=1.0, cache=False)
    zstore.append(tmp_path / "b.h5", dst, workers=1, progress=False)
    copy = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker gets
    assert len(copy) == len(ds) == 2
    assert len(zstore.WindowDataset(dst, window_seconds=1.0, cache=False)) == 3


def test_shortest_lengths_in_the_header_open_the_same_dataset(tmp_path):
    """The header's shortest item lengths let a dataset skip reading every item's length
    when the window fits them all; what it serves is the same as from a full scan, and an
    append of a shorter item lowers them."""
    many_items(tmp_path)
    dst = tmp_path / "s.zarr"
    zstore.convert(tmp_path / "many.h5", dst, rates=RATES, workers=1, progress=False)
    shortest = manifest_of(dst).extra["min_lengths"]
    assert (shortest["wav"], shortest["act"]) == (1600, 10)
    fast = zstore.WindowDataset(
        dst, window_seconds=0.05, seed=4, fields=["wav", "act"], cache=False
    )
    scanned_store = tmp_path / "scanned.zarr"
    shutil.copytree(dst, scanned_store)
    edit_header(scanned_store, lambda h: {k: v for k, v in h.items() if k != "min_lengths"})
    scanned = zstore.WindowDataset(
        scanned_store, window_seconds=0.05, seed=4, fields=["wav", "act"], cache=False
    )
    assert len(fast) == len(scanned) == 300
    from zstore.format.sizing import field_sizes

    summed = manifest_of(scanned_store)
    summed.extra.pop("sizes")
    assert field_sizes(manifest_of(dst), fast.reader._metas) == field_sizes(
        summed, scanned.reader._metas
    )
    assert fast.item_lengths() == scanned.item_lengths()
    worker = pickle.loads(pickle.dumps(fast))
    for i in (0, 1, 150, 299):
        a, b, c = fast[i], scanned[i], worker[i]
        assert a["item"] == b["item"] == c["item"] and a["start"] == b["start"] == c["start"]
        assert np.array_equal(a["wav"].numpy(), b["wav"].numpy())
        assert np.array_equal(a["act"].numpy(), c["act"].numpy())

    write_h5(
        tmp_path / "short.h5",
        {"tiny": {"wav": np.ones((1, 400), np.float32), "act": np.ones((2, 2), np.float32)}},
    )
    zstore.append(tmp_path / "short.h5", dst, workers=1, progress=False)
    shortest = manifest_of(dst).extra["min_lengths"]
    assert (shortest["wav"], shortest["act"]) == (400, 2)
    with pytest.warns(UserWarning, match="1 item"):
        skipping = zstore.WindowDataset(
            dst, window_seconds=0.05, short="skip", cache=False, fields=["wav", "act"]
        )
    assert skipping.short_items == ["tiny"] and len(skipping) == 300


@pytest.mark.parametrize(
    "shape,chunks,shards,codec,dtype",
    [
        ((2, 7037), (2, 100), (2, 6400), "zstd", "float32"),  # a partial last shard and chunk
        ((1000, 2), (300, 2), (1200, 2), "lz4", ">f4"),  # time first, big-endian source
        ((4, 5000), (4, 1000), (4, 5000), "lz4", "bool"),
        ((5, 7), (5, 7), None, "none", "int16"),  # stored whole
    ],
)
def test_the_object_writer_equals_zarr(tmp_path, shape, chunks, shards, codec, dtype):
    from zstore.convert.pipeline import compressors

    data = (np.random.default_rng(0).standard_normal(shape) * 100).astype(dtype)
    group = zarr.open_group(tmp_path / "z.zarr", mode="w")
    arr = group.create_array(
        "x",
        shape=shape,
        dtype=data.dtype,
        chunks=chunks,
        shards=shards,
        compressors=compressors(codec),
        fill_value=0,
        config={"write_empty_chunks": True},
    )
    arr[...] = data
    axis = 0 if shape == (1000, 2) else -1
    objects = encode_array(data, chunks, shards, codec, axis)
    base = tmp_path / "z.zarr" / "x"
    files = {
        str(p.relative_to(base)): p.read_bytes()
        for p in base.rglob("*")
        if p.is_file() and p.name != "zarr.json"
    }
    assert files == objects
    assert json.loads((base / "zarr.json").read_text()) == array_meta(
        shape, data.dtype, chunks, shards, codec
    )
