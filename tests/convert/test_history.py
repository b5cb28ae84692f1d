"""The store's history (its source files, appends, what was left out) is kept beside the
item table, not in the root ``zarr.json`` that every round of origin reads reads again:
the root stays the same size however many files the store was made from."""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest
from conftest import edit_header, manifest_of, write_h5, zstore_cli

import zstore
from zstore.format import MANIFEST_ATTR


def files(directory, names, seconds=1.0, seed=0):
    """One HDF5 file per name, each with one group of int16-valued float audio."""
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    out = {}
    for name in names:
        wav = np.round(rng.standard_normal((1, int(16000 * seconds))) * 900).astype(np.float32)
        # the group named as the file: unique in any store
        out[write_h5(os.path.join(directory, f"{name}.h5"), {name: {"wav": wav}})] = wav
    return out


def root_size(store) -> int:
    return os.path.getsize(os.path.join(store, "zarr.json"))


def convert(src, dst, **kw):
    return zstore.convert(src, dst, rates={"wav": 16000}, progress=False, workers=1, **kw)


def read_all(store, expected):
    """Every item read whole through the public API equals its source file's array."""
    ds = zstore.WindowDataset(store, window_seconds=None, cache=False)
    got = {ds[i]["item"]: ds[i]["wav"].numpy() for i in range(len(ds))}
    assert len(got) == len(expected)
    for path, wav in expected.items():
        stem = os.path.splitext(os.path.basename(path))[0]
        name = next(n for n in got if n.split("/")[-1] == stem)
        assert np.array_equal(got[name], wav), name


def test_the_root_does_not_grow_with_the_source_files(tmp_path):
    few = files(tmp_path / "few", [f"rec{i:03d}" for i in range(2)])
    many = files(tmp_path / "many", [f"rec{i:03d}" for i in range(60)])
    convert(tmp_path / "few", tmp_path / "few.zarr")
    report = convert(tmp_path / "many", tmp_path / "many.zarr")
    assert report.items == 60
    # the counts' digits apart: before, each file added ~110 bytes to the root
    assert abs(root_size(tmp_path / "many.zarr") - root_size(tmp_path / "few.zarr")) < 64
    read_all(tmp_path / "few.zarr", few)
    read_all(tmp_path / "many.zarr", many)
    # the history is kept: the converter reads it
    manifest = manifest_of(tmp_path / "many.zarr")
    assert len(manifest.extra["sources"]) == 60
    assert len(manifest.extra["fingerprint"]["sources"]) == 60
    # the rerun of the same conversion does nothing; one of other files is refused,
    # naming what differs, which it reads from the history
    again = convert(tmp_path / "many", tmp_path / "many.zarr")
    assert again.converted == 0 and again.items == 60
    with pytest.raises(zstore.DestinationError, match="sources not given now: .*rec002.h5"):
        convert(tmp_path / "few", tmp_path / "many.zarr")
    # items named by their file (several sources), as before: the count is in the root
    ds = zstore.WindowDataset(
        tmp_path / "many.zarr", items=["rec007"], window_seconds=1.0, cache=False
    )
    assert {ds[i]["item"] for i in range(len(ds))} == {"rec007/rec007"}


def test_appends_add_their_short_record_to_the_root_alone(tmp_path):
    first = files(tmp_path / "src", ["base"])
    store = tmp_path / "s.zarr"
    convert(next(iter(first)), store)
    sizes = [root_size(store)]
    added = dict(first)
    for i in range(8):
        new = files(tmp_path / f"new{i}", [f"day{i:02d}"], seed=i + 1)
        path = next(iter(new))
        report = zstore.append(path, store, progress=False, workers=1)
        assert report.converted == 1
        again = zstore.append(path, store, progress=False, workers=1)  # a rerun: nothing
        assert again.converted == 0 and again.already_in_store == [path]
        sizes.append(root_size(store))
        added.update(new)
    grew = np.diff(sizes)
    # an append's record alone (its id, its first item, and for these short items, packed,
    # its first shard and batch: ~100 bytes); its file's path and identity go into the
    # history (before: ~270 bytes an appended file)
    assert grew.max() <= 128, sizes
    manifest = manifest_of(store)
    assert len(manifest.extra["appended"]) == 8 and len(manifest.extra["sources"]) == 9
    read_all(store, added)


def test_zstore_info_shows_what_the_history_holds(tmp_path):
    src = files(tmp_path / "src", ["a", "b"])
    path = next(iter(src))
    with h5py.File(path, "a") as f:
        f["text/words"] = np.array([b"one", b"two"], dtype=h5py.string_dtype())
    with pytest.warns(UserWarning, match="skipping a:text/words"):
        convert(tmp_path / "src", tmp_path / "s.zarr")
    proc = zstore_cli("info", str(tmp_path / "s.zarr"), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert any("words" in line for line in info["skipped"]), info["skipped"]
    assert len(info["sources"]) == 2 and info["appended_sources"] == 0
    assert "sources: 2 file(s) (a.h5, b.h5)" in info["text"]
    with open(tmp_path / "s.zarr" / "zarr.json") as f:
        header = json.load(f)["attributes"][MANIFEST_ATTR]
    assert "skipped" not in header and "sources" not in header and "fingerprint" not in header


def test_a_store_with_its_history_in_the_root(tmp_path):
    """Stores written before kept the history in the root: they are read, rerun and
    appended to as before, and an append moves the history out of the root."""
    src = files(tmp_path / "src", ["a", "b", "c"])
    store = tmp_path / "old.zarr"
    convert(tmp_path / "src", store)
    history = manifest_of(store).extra
    moved = {k: history[k] for k in ("fingerprint", "sources")}

    def as_before(header):
        header = {k: v for k, v in header.items() if k != "history"}
        return {**header, **moved}

    edit_header(store, as_before)
    table = store / manifest_of(store).table / "zarr.json"  # as written before: no history
    meta = json.loads(table.read_text())
    meta["attributes"] = {"zstore": "the item table of this store (names and shapes)"}
    table.write_text(json.dumps(meta))
    big = root_size(store)
    again = convert(tmp_path / "src", store)  # the rerun of its conversion: nothing
    assert again.converted == 0
    new = files(tmp_path / "new", ["d"], seed=9)
    zstore.append(next(iter(new)), store, progress=False, workers=1)
    assert root_size(store) < big
    manifest = manifest_of(store)
    assert len(manifest.extra["sources"]) == 4
    assert manifest.extra["fingerprint"] == moved["fingerprint"]
    assert zstore.append(next(iter(new)), store, progress=False, workers=1).converted == 0
    read_all(store, {**src, **new})


def test_history_on_s3(tmp_path, s3):
    """The history object is written and read through the same origin as the store."""
    options, _ = s3
    src = files(tmp_path / "src", ["a", "b"])
    new = files(tmp_path / "new", ["c"], seed=3)
    url = "s3://zstore-test/history.zarr"
    zstore.convert(
        tmp_path / "src",
        url,
        rates={"wav": 16000},
        progress=False,
        workers=1,
        storage_options=options,
    )
    report = zstore.append(next(iter(new)), url, progress=False, workers=1, storage_options=options)
    assert report.converted == 1
    again = zstore.append(next(iter(new)), url, progress=False, workers=1, storage_options=options)
    assert again.converted == 0
    from zstore.format import read_manifest

    manifest = read_manifest(url, options, history=True)[0]
    assert len(manifest.extra["sources"]) == 3
    ds = zstore.WindowDataset(url, window_seconds=None, cache=False, storage_options=options)
    assert len(ds) == 3
    got = {ds[i]["item"]: ds[i]["wav"].numpy() for i in range(3)}
    for path, wav in {**src, **new}.items():
        stem = os.path.splitext(os.path.basename(path))[0]
        assert np.array_equal(got[f"{stem}/{stem}"], wav)
    assert "sources" not in read_manifest(url, options)[0].extra  # readers go without


def test_zstore_upgrade_moves_the_history_out_of_the_root(tmp_path):
    """A store written before, with no append to come, shrinks its root with `zstore
    upgrade`: metadata only, under the store's lock; a job opened before reads on."""
    src = files(tmp_path / "src", [f"rec{i:02d}" for i in range(30)])
    store = tmp_path / "old.zarr"
    convert(tmp_path / "src", store)
    history = manifest_of(store).extra
    moved = {k: history[k] for k in ("fingerprint", "sources")}
    edit_header(store, lambda h: {**{k: v for k, v in h.items() if k != "history"}, **moved})
    big = root_size(store)
    cache = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=None)
    job = zstore.WindowDataset(store, window_seconds=None, cache=cache)
    by_stem = {os.path.splitext(os.path.basename(p))[0]: v for p, v in src.items()}

    def check(ds, which):
        for i in which:
            w = ds[i]
            assert np.array_equal(w["wav"].numpy(), by_stem[w["item"].split("/")[-1]])

    check(job, range(5))
    proc = zstore_cli("upgrade", str(store))
    assert proc.returncode == 0, proc.stderr
    assert "history" in proc.stdout and "no chunk" in proc.stdout
    assert root_size(store) < big - 30 * 100
    # the job reads on: items not read before come in rounds that check the new root
    check(job, range(len(job)))
    read_all(store, src)  # a job opened now, without tiers
    check(zstore.WindowDataset(store, window_seconds=None, cache=cache), range(30))
    manifest = manifest_of(store)
    assert manifest.extra["fingerprint"] == moved["fingerprint"]
    assert convert(tmp_path / "src", store).converted == 0  # the rerun still does nothing
    again = zstore_cli("upgrade", str(store))
    assert again.returncode == 0 and "nothing to do" in again.stdout
