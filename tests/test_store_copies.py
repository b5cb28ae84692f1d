"""Copies of a store, and a store restored from a backup, share its store id: the items
each of them gains by an append after that are not the same data, though they lie at
the same paths (the same item names; packed items in the same new shards and batch
records).  A node cache shared by jobs reading both must never serve one's chunks for
the other's."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import write_h5

import zstore
from zstore.format.layout import Span

MODES = {
    "auto": {},
    "decoded": dict(ram_format="decoded"),
    "encoded": dict(ram_format="encoded"),
    "ssd-only": dict(ram_bytes=0),
    "shard-fetch": dict(fetch="shard"),
}
#: seconds of each item: long ones keep their own group, short ones are packed
LENGTHS = {"own": 12, "packed": 2}


def level_items(path: Path, names: list[str], level: int, seconds: int) -> str:
    """An HDF5 file of items whose every ``wav`` sample is within 7 of ``level`` (and a
    label with the level): which file a value came from shows in the value."""
    n = 16000 * seconds
    return write_h5(
        path,
        {
            g: {
                "wav": ((level + np.arange(n) % 7)[None] / 32768).astype(np.float32),
                "lab": np.int32(level),  # a scalar label: read through zarr, or a record
            }
            for g in names
        },
        {g: {"level": level} for g in names},
    )


def levels(
    store: Path, cache: zstore.CacheConfig, items: list[str], labels: bool = True
) -> dict[str, int]:
    """Per item, the level its whole ``wav`` holds, read twice through ``cache`` (a
    reader's first reads are not kept in the RAM tier); -1 for values of no one level,
    a second read that differs, or a label or attribute of another level."""
    reader = zstore.WindowReader(str(store), cache=cache).open()
    out = {}
    for item in items:
        wav = reader.read(item, {"wav": None})["wav"] * 32768
        low, high = int(round(float(wav.min()))), int(round(float(wav.max())))
        again = reader.read(item, {"wav": None, **({"lab": None} if labels else {})})
        same = np.array_equal(wav, again["wav"] * 32768)
        said = {low}
        if labels:
            said = {
                int(again["lab"]),
                int(reader.item_attrs(reader.manifest.position(item))["level"]),
            }
        out[item] = low if high - low <= 6 and same and said == {low} else -1
    reader.settle()
    return out


def cache_for(tmp_path: Path, mode: str) -> zstore.CacheConfig:
    base = dict(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=tmp_path / "ssd", ssd_bytes="256MB"
    )
    return zstore.CacheConfig(**{**base, **MODES[mode]})


def two_copies(tmp_path: Path, base: list[str], new: list[str], seconds: int) -> tuple[Path, Path]:
    """A store of items ``base`` (level 0) and a copy of it; items ``new`` appended to
    the store at level 1000 and to the copy at level -2000."""
    a, b = tmp_path / "A.zarr", tmp_path / "B.zarr"
    source = level_items(tmp_path / "base.h5", base, 0, seconds)
    zstore.convert(source, a, rates={"wav": 16000}, workers=1, progress=False)
    shutil.copytree(a, b)
    for store, level in ((a, 1000), (b, -2000)):
        (tmp_path / str(level)).mkdir()
        added = level_items(tmp_path / str(level) / "new.h5", new, level, seconds)
        zstore.append(added, store, workers=1, progress=False)
    return a, b


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(LENGTHS))
def test_copies_appended_with_other_items_of_the_same_names_never_mix(tmp_path, mode, kind):
    a, b = two_copies(tmp_path, ["r0", "r1"], ["n0", "n1"], LENGTHS[kind])
    cache = cache_for(tmp_path, mode)
    items = ["r0", "n0", "n1"]
    for _ in range(2):  # the second time from the tiers
        assert levels(a, cache, items) == {"r0": 0, "n0": 1000, "n1": 1000}
        assert levels(b, cache, items) == {"r0": 0, "n0": -2000, "n1": -2000}
    if kind == "packed":
        reader = zstore.WindowReader(str(b), cache=cache)
        assert reader.read("n0", {"wav": Span(0, 10)})["wav"].max() * 32768 < 0


def appended_wrong(tmp_path: Path) -> tuple[Path, Path, str]:
    """A store of ``r0`` (level 0), its backup, then a file of ``n0`` at level 1000
    appended to it (gone wrong); and the right file of ``n0`` (level -2000)."""
    base = level_items(tmp_path / "base.h5", ["r0"], 0, 12)
    store, backup = tmp_path / "s.zarr", tmp_path / "backup.zarr"
    zstore.convert(base, store, rates={"wav": 16000}, workers=1, progress=False)
    shutil.copytree(store, backup)
    (tmp_path / "wrong").mkdir()
    (tmp_path / "right").mkdir()
    wrong = level_items(tmp_path / "wrong" / "new.h5", ["n0"], 1000, 12)
    zstore.append(wrong, store, workers=1, progress=False)
    return store, backup, level_items(tmp_path / "right" / "new.h5", ["n0"], -2000, 12)


def test_a_store_restored_and_appended_again_is_read_anew(tmp_path):
    """An append gone wrong, the store restored from a backup taken before it, and the
    right file appended: jobs on the node read the right file's values."""
    store, backup, right = appended_wrong(tmp_path)
    cache = cache_for(tmp_path, "auto")
    assert levels(store, cache, ["n0"]) == {"n0": 1000}
    shutil.rmtree(store)
    shutil.copytree(backup, store)
    zstore.append(right, store, workers=1, progress=False)
    assert levels(store, cache, ["r0", "n0"]) == {"r0": 0, "n0": -2000}


def test_the_original_items_stay_cached_across_appends(tmp_path):
    """What an append keeps: the chunks of the items it did not write are read from the
    tiers by a job opened after it."""
    base = level_items(tmp_path / "base.h5", ["r0", "r1"], 0, 12)
    store = tmp_path / "s.zarr"
    zstore.convert(base, store, rates={"wav": 16000}, workers=1, progress=False)
    cache = cache_for(tmp_path, "auto")
    levels(store, cache, ["r0", "r1"], labels=False)
    (tmp_path / "more").mkdir()
    zstore.append(
        level_items(tmp_path / "more" / "new.h5", ["n0"], 1000, 12),
        store,
        workers=1,
        progress=False,
    )
    before = zstore.cache_stats(cache)["ram"]
    assert levels(store, cache, ["r0", "r1"], labels=False) == {"r0": 0, "r1": 0}
    after = zstore.cache_stats(cache)["ram"]
    assert after["misses"] == before["misses"], (before, after)
    assert after["hits"] > before["hits"], (before, after)
    assert levels(store, cache, ["n0"]) == {"n0": 1000}


def test_warm_and_the_shares_residency_see_each_copys_own_appends(tmp_path):
    """``zstore cache warm`` of one copy fills what that copy's jobs read, and the
    residency ``cache stats --store`` reports counts the other copy's appended shards as
    not held."""
    from zstore.cli.warm import share_residency

    a, b = two_copies(tmp_path, ["r0", "r1"], ["n0"], 12)
    cache = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=None)
    zstore.warm(str(a), fields=["wav"], cache=cache, progress=False)
    held = share_residency(str(a), cache=cache, fields=["wav"])
    assert held["resident_in_ram"] == held["shards"] == 3, held
    other = share_residency(str(b), cache=cache, fields=["wav"])
    assert other["resident_in_ram"] == 2, other  # r0 and r1: the same data in both
    assert levels(b, cache, ["n0", "r0"]) == {"n0": -2000, "r0": 0}


@pytest.mark.parametrize("cached", [False, True])
def test_a_store_restored_under_a_running_job_stops_it(tmp_path, cached):
    """A job opened after an append; the store is then restored from a backup taken
    before it and appended to with another file of the same item names.  The store id
    is the same, but the job's view of ``n0`` is of data no longer there: it must stop
    with StoreReplacedError, never read the new ``n0`` under its old one."""
    store, backup, right = appended_wrong(tmp_path)
    cache = cache_for(tmp_path, "auto") if cached else None
    job = zstore.WindowReader(str(store), cache=cache).open()
    assert job.read("r0", {"wav": Span(0, 16000)})["wav"].min() == 0
    shutil.rmtree(store)
    shutil.copytree(backup, store)
    zstore.append(right, store, workers=1, progress=False)
    with pytest.raises(zstore.StoreReplacedError, match="restored|appends"):
        job.read("n0", {"wav": None})
    # a job opened now reads the store as it is
    assert levels(store, cache or cache_for(tmp_path, "auto"), ["n0"]) == {"n0": -2000}


@pytest.mark.parametrize("append_again", [False, True])
def test_a_worker_of_a_job_opened_before_a_restore_says_so(tmp_path, append_again):
    """A DataLoader worker unpickles its job's reader after the store was restored from
    a backup taken before the append the job saw: the item table it names is gone, and
    the error says the store was restored, not that 'zstore tidy' removed the table."""
    import pickle

    store, backup, right = appended_wrong(tmp_path)
    job = zstore.WindowDataset(store, window_seconds=None, cache=False)
    shutil.rmtree(store)
    shutil.copytree(backup, store)
    if append_again:
        zstore.append(right, store, workers=1, progress=False)
    with pytest.raises(zstore.StoreReplacedError, match="restored from a backup") as e:
        pickle.loads(pickle.dumps(job))[0]
    assert "tidy" not in str(e.value)


def test_a_read_cut_short_by_a_restored_store_says_the_store_was_replaced(tmp_path):
    """The job holds a shard's index from before the restore; the restored store's
    object is shorter, so the job's ranges reach past its end.  The failed read is
    checked against the root before it is reported: StoreReplacedError, not "reading
    the origin failed" (an OriginError after six retries, found on S3 by
    tools/random_corpora.py copies)."""
    base = level_items(tmp_path / "base.h5", ["r0"], 0, 12)
    store, backup = tmp_path / "s.zarr", tmp_path / "backup.zarr"
    zstore.convert(base, store, rates={"wav": 16000}, workers=1, progress=False)
    shutil.copytree(store, backup)
    for name, seconds in (("long", 40), ("short", 11)):
        (tmp_path / name).mkdir()
        level_items(tmp_path / name / "new.h5", ["n0"], 1000 if seconds == 40 else -2000, seconds)
    zstore.append(tmp_path / "long" / "new.h5", store, workers=1, progress=False)
    job = zstore.WindowReader(str(store), cache=None).open()
    assert job.read("n0", {"wav": Span(0, 16000)})["wav"].min() * 32768 == 1000
    shutil.rmtree(store)
    shutil.copytree(backup, store)
    zstore.append(tmp_path / "short" / "new.h5", store, workers=1, progress=False)
    with pytest.raises(zstore.StoreReplacedError, match="restored"):
        job.read("n0", {"wav": Span(35 * 16000, 36 * 16000)})


def test_zarrs_api_keeps_copies_apart_and_stops_on_a_restored_store(tmp_path):
    """``zstore.open_store`` (zarr's API through the tiers): each copy's appended items
    its own, and a store restored under an open group stops its reads."""
    import zarr

    a, b = two_copies(tmp_path, ["r0"], ["n0"], 12)
    cache = cache_for(tmp_path, "auto")
    for _ in range(2):
        for store, level in ((a, 1000), (b, -2000)):
            group = zarr.open_group(zstore.open_store(str(store), cache=cache), mode="r")
            assert round(float(group["n0/wav"][0, :100].min()) * 32768) == level
            assert int(group["n0/lab"][()]) == level
    group = zarr.open_group(zstore.open_store(str(a), cache=cache), mode="r")
    wav = group["n0/wav"]
    shutil.rmtree(a)
    shutil.copytree(b, a)  # another copy put in its place
    with pytest.raises(zstore.StoreReplacedError, match="restored"):
        wav[0, 160000:176000]
