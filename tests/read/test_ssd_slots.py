"""The SSD tier filled by the reads (a remote origin read by ranges): each chunk a read
fetches is written into its shard's slot in the SSD tier, with the shard index; a
later job reads those from the tier, not the origin; a chunk the RAM tier keeps is
not kept twice; a damaged slot is fetched again; a tier smaller than the store keeps
its budget; ``fetch="auto"`` reads whole shards only where the origin's round trip is
long, and every process of a node agrees.
Real HDF5 files written by h5py, converted, read through the public API."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
from test_chunk_shards import _store, odd_store

import zstore
from zstore.format import Span
from zstore.read.reader import WindowReader
from zstore.testing import ModelledFileSystem

SPANS = {
    "wav": Span(3 * 16000, 41 * 16000),
    "act": Span(300, 4100),
    "spec": Span(300, 4100),
}


def _cache(tmp_path: Path, ram_bytes: str | int = 0, fetch: str = "slots") -> zstore.CacheConfig:
    """An SSD tier (and a RAM tier of ``ram_bytes``); ``fetch="slots"`` unless the test is
    of ``auto``'s choice (which times the origin)."""
    return zstore.CacheConfig(
        ram_dir=tmp_path / "ram" if ram_bytes else None,
        ram_bytes=ram_bytes,
        ssd_dir=tmp_path / "ssd",
        ssd_bytes="1GB",
        fetch=fetch,
    )


def _reader(store: str, cache: zstore.CacheConfig, fs: ModelledFileSystem) -> WindowReader:
    reader = WindowReader(store, cache=cache, origin_fs=fs, fields=list(SPANS)).open()
    reader.start_builds()  # past the node's first reads
    return reader


def _check(got: dict[str, np.ndarray], data: dict[str, dict], item: str) -> None:
    src = data[item]
    for name, span in SPANS.items():
        want = src[name][:, span.start : span.stop]  # time on the second axis
        assert np.array_equal(got[name].view(np.uint32), want.view(np.uint32)), name


def _ssd(cache: zstore.CacheConfig) -> dict:
    return zstore.cache_stats(cache)["ssd"]


@pytest.mark.parametrize("kind", ["int16", "float"])
def test_reads_fill_the_ssd_tier_and_a_later_job_reads_only_the_root(tmp_path, kind):
    store, data = _store(tmp_path, kind)
    cache = _cache(tmp_path)
    fs = ModelledFileSystem()
    reader = _reader(store, cache, fs)
    assert reader.fetch == "slots"
    _check(reader.read("rec1", SPANS), data, "rec1")
    first = _ssd(cache)
    assert first["fills"] > 0 and first["corrupt"] == 0
    # one value per shard (the slots), not one per chunk
    shards = sum(1 for name in SPANS for _ in Path(store, "rec1", name, "c").rglob("*"))
    assert first["entries"] <= shards + 1

    later = ModelledFileSystem()  # a later job: a fresh process's reader
    again = _reader(store, cache, later)
    _check(again.read("rec1", SPANS), data, "rec1")
    assert later.data_requests == 0  # chunks and shard indexes from the SSD tier
    assert _ssd(cache)["hits"] >= first["fills"]
    assert _ssd(cache)["fills"] == first["fills"]


def test_a_damaged_slot_is_fetched_again(tmp_path):
    store, data = _store(tmp_path, "int16", items=1)
    cache = _cache(tmp_path)
    _check(_reader(store, cache, ModelledFileSystem()).read("rec0", SPANS), data, "rec0")
    damaged = 0
    for path in Path(tmp_path, "ssd").rglob("*"):
        if path.is_file() and path.stat().st_size > 1 << 20:  # a shard's value
            with open(path, "r+b") as f:
                raw = bytearray(f.read())
                at = [i for i in range(8192, len(raw), 4099) if raw[i]]
                for i in at:
                    raw[i] ^= 0x5A
                f.seek(0)
                f.write(raw)
                damaged += bool(at)
    assert damaged
    fs = ModelledFileSystem()
    _check(_reader(store, cache, fs).read("rec0", SPANS), data, "rec0")
    assert fs.data_requests > 0  # the damaged chunks, from the origin


def test_a_chunk_the_ram_tier_keeps_is_not_kept_in_the_ssd_tier_too(tmp_path):
    store, data = _store(tmp_path, "int16", items=1)
    roomy = _cache(tmp_path / "roomy", ram_bytes="256MB")
    reader = _reader(store, roomy, ModelledFileSystem())
    assert reader.format_choice is not None and reader.format_choice.format == "chunks"
    _check(reader.read("rec0", SPANS), data, "rec0")
    assert zstore.cache_stats(roomy)["ram"]["fills"] > 0
    assert _ssd(roomy)["fills"] == 0
    # a RAM tier too small for the audio's shards: the SSD tier keeps their chunks
    small = _cache(tmp_path / "small", ram_bytes="1MB")
    _check(_reader(store, small, ModelledFileSystem()).read("rec0", SPANS), data, "rec0")
    assert zstore.cache_stats(small)["ram"]["fill_bytes"] < 2**20
    assert _ssd(small)["fills"] > 0


def test_chunks_completed_behind_the_reads_are_kept_in_the_ram_tier_only(tmp_path):
    """A shard mostly read has its other chunks decoded and written behind the reads
    (the RAM tier's completion): they go into the RAM tier, not into the SSD tier's
    slots as well (with 4 ranks each such SSD write indexed a value in the reading
    process's builder thread, and the later epochs read slower with the SSD tier than
    without it)."""
    store, data = _store(tmp_path, "int16", items=1)
    cache = _cache(tmp_path, ram_bytes="256MB")
    reader = _reader(store, cache, ModelledFileSystem())
    reader.read("rec0", {"wav": Span(0, 56 * 16000)})  # 56 of the first shard's 64 s
    filled = zstore.cache_stats(cache)["ram"]["fills"]
    reader.read("rec0", {"wav": Span(0, 16000)})  # finds most of it in the tier
    assert reader.settle(timeout=120)
    assert zstore.cache_stats(cache)["ram"]["fills"] > filled  # the shard completed
    assert _ssd(cache)["fills"] == 0
    fs = ModelledFileSystem()  # the rest of that shard, from the RAM tier
    got = WindowReader(store, cache=cache, origin_fs=fs, fields=["wav"]).open()
    wav = got.read("rec0", {"wav": Span(58 * 16000, 63 * 16000)})["wav"]
    assert np.array_equal(
        wav.view(np.uint32), data["rec0"]["wav"][:, 58 * 16000 : 63 * 16000].view(np.uint32)
    )
    assert fs.data_requests == 0


def test_a_chunk_the_ram_tier_cannot_keep_is_kept_in_the_ssd_tier(tmp_path):
    """The manifest says int16 samples and one chunk holds a value that is not one: the
    RAM tier leaves that chunk out, and the SSD tier keeps it instead, so a later job
    fetches nothing from the origin."""
    store, data = odd_store(tmp_path)
    cache = _cache(tmp_path, ram_bytes="256MB")
    whole = {"wav": Span(0, 70 * 16000)}
    for _ in range(2):  # the first read ends the hold; the second writes
        reader = WindowReader(store, cache=cache, origin_fs=ModelledFileSystem(), fields=["wav"])
        reader.start_builds()
        got = reader.read("rec0", whole)["wav"]
        assert np.array_equal(got.view(np.uint32), data["rec0"]["wav"].view(np.uint32))
    assert _ssd(cache)["fills"] == 1  # that chunk alone
    fs = ModelledFileSystem()
    got = WindowReader(store, cache=cache, origin_fs=fs, fields=["wav"]).open().read("rec0", whole)
    assert np.array_equal(got["wav"].view(np.uint32), data["rec0"]["wav"].view(np.uint32))
    assert fs.data_requests == 0


def test_auto_fetches_whole_shards_only_over_a_long_round_trip_and_the_node_agrees(tmp_path):
    store, data = _store(tmp_path, "int16", items=1)
    far = _cache(tmp_path / "far", fetch="auto")
    reader = _reader(store, far, ModelledFileSystem(latency=0.02))
    assert reader.fetch == "shard"
    _check(reader.read("rec0", SPANS), data, "rec0")
    records = list(Path(tmp_path, "far").rglob("round-trips/*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["seconds"] >= 0.02
    # the node's other processes use the record, whatever their own first reads took
    assert _reader(store, far, ModelledFileSystem()).fetch == "shard"
    near = _cache(tmp_path / "near", fetch="auto")
    assert _reader(store, near, ModelledFileSystem()).fetch == "slots"
    # an SSD tier too small for the store: ranges into the slots, whatever the round trip
    small = zstore.CacheConfig(
        ram_dir=None, ram_bytes=0, ssd_dir=tmp_path / "small", ssd_bytes="1MB"
    )
    assert _reader(store, small, ModelledFileSystem(latency=0.02)).fetch == "slots"
    # explicit settings are kept: "range" keeps each chunk as its own value, under the
    # node's locks
    ranged = zstore.CacheConfig(
        ram_dir=None, ram_bytes=0, ssd_dir=tmp_path / "r", ssd_bytes="1GB", fetch="range"
    )
    reader = _reader(store, ranged, ModelledFileSystem(latency=0.02))
    assert reader.fetch == "range" and reader.source.slotted is None
    _check(reader.read("rec0", SPANS), data, "rec0")
    stats = _ssd(ranged)
    assert stats["entries"] == stats["fills"] > 2 * len(SPANS)  # indexes and chunks


def _read_in_process(store: str, cache: zstore.CacheConfig, item: str, barrier, queue) -> None:
    fs = ModelledFileSystem()
    reader = _reader(store, cache, fs)
    barrier.wait()  # both read the same shards at once
    got = reader.read(item, SPANS)
    queue.put({name: np.array(a) for name, a in got.items()})


def test_two_processes_fill_the_same_slots_at_once(tmp_path):
    store, data = _store(tmp_path, "float", items=1)
    cache = _cache(tmp_path)
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_read_in_process, args=(store, cache, "rec0", barrier, queue))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    got = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    for one in got:
        _check(one, data, "rec0")
    fs = ModelledFileSystem()  # a third reads every chunk from the slots both wrote
    _check(_reader(store, cache, fs).read("rec0", SPANS), data, "rec0")
    assert fs.data_requests == 0 and _ssd(cache)["corrupt"] == 0
    assert os.path.isdir(tmp_path / "ssd")


def test_a_fresh_jobs_first_reads_write_nothing(tmp_path):
    """The node's first reads (the reader's hold on its builds) keep nothing in the
    slots: the first batch costs what it costs with no tier; read again, they do."""
    store, data = _store(tmp_path, "int16", items=1)
    cache = _cache(tmp_path)
    reader = WindowReader(store, cache=cache, origin_fs=ModelledFileSystem(), fields=list(SPANS))
    _check(reader.read("rec0", SPANS), data, "rec0")
    assert _ssd(cache)["fills"] == 0
    _check(reader.read("rec0", SPANS), data, "rec0")  # the hold ends with the first read
    assert _ssd(cache)["fills"] > 0


def test_admission_periods_count_the_values_each_tier_holds() -> None:
    """The admission counts are halved every few passes over a tier's values: the SSD
    tier holds a value per shard object under ``slots`` and ``shard``, per chunk under
    ``range``; the RAM tier per shard (``chunks``, ``decoded``) or per chunk
    (``encoded``)."""
    from zstore.format import Sizes
    from zstore.read._reader_open import PASSES, admission_periods

    sizes = Sizes(decoded_bytes=1, stored_bytes=1, shards=700, chunks=44_800)
    assert admission_periods(sizes, "chunks", "slots") == (PASSES * 700, PASSES * 700)
    assert admission_periods(sizes, "decoded", "shard") == (PASSES * 700, PASSES * 700)
    assert admission_periods(sizes, "encoded", "range") == (PASSES * 44_800, PASSES * 44_800)
    assert admission_periods(sizes, "chunks", "range") == (PASSES * 700, PASSES * 44_800)


def test_an_ssd_tier_smaller_than_the_store_keeps_its_budget_and_the_values(tmp_path):
    """With room for about half the store's shards, the slots' values are admitted and
    evicted by the tier's rules (reads that move to one item: its shards displace
    the others' once read clearly more often); every window
    equals the source, the tier stays within its budget, and nothing is corrupt."""
    store, data = _store(tmp_path, "float", items=3)
    stored = sum(p.stat().st_size for p in Path(store).rglob("*") if p.is_file())
    budget = stored // 2
    cache = zstore.CacheConfig(
        ram_dir=None, ram_bytes=0, ssd_dir=tmp_path / "ssd", ssd_bytes=budget, fetch="slots"
    )
    fs = ModelledFileSystem()
    reader = _reader(store, cache, fs)
    rng = np.random.default_rng(5)
    for item, reads in [("rec0", 3), ("rec1", 3), ("rec2", 30), ("rec0", 3)]:
        src = data[item]
        for _ in range(reads):
            start = int(rng.integers(0, src["act"].shape[1] - 2000))
            wav, act = Span(start * 160, (start + 2000) * 160), Span(start, start + 2000)
            got = reader.read(item, {"wav": wav, "act": act})
            assert np.array_equal(got["wav"], src["wav"][:, wav.start : wav.stop])
            assert np.array_equal(got["act"], src["act"][:, act.start : act.stop])
    stats = _ssd(cache)
    assert stats["fills"] > 0 and stats["hits"] > 0 and stats["corrupt"] == 0
    assert stats["evictions"] > 0
    assert stats["bytes_on_disk"] <= budget


@pytest.mark.parametrize("fetch", ["slots", "range", None])
def test_a_chunk_two_windows_of_a_batch_share_is_fetched_once(tmp_path, fetch):
    """Two windows of one batch over the same part of an item (4 windows per item of a
    few seconds, shuffled, often land together) fetch each chunk they share once, with
    the SSD tier's slots, its chunk values, and no tier: as many origin requests as the
    one window alone, and both windows read right."""
    store, data = _store(tmp_path, "int16", items=1)
    cache = _cache(tmp_path / str(fetch), fetch=fetch) if fetch else False
    counts = []
    for windows in (1, 2):
        fs = ModelledFileSystem()
        reader = WindowReader(store, cache=cache, origin_fs=fs, fields=list(SPANS))
        shapes = reader.read("rec0", SPANS)  # the hold ends (its writes settled below)
        assert reader.settle(timeout=120)
        if cache:
            zstore.clear_cache(cache)
        fs.reset_counts()
        outs = [{k: np.empty_like(v) for k, v in shapes.items()} for _ in range(windows)]
        reader.read_batch([("rec0", dict(SPANS), None)] * windows, outs)
        for out in outs:
            _check(out, data, "rec0")
        counts.append(fs.data_requests)
    assert counts[0] > 0 and counts[1] == counts[0]
