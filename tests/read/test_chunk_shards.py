"""The RAM tier filled by the reads themselves (``ram_format="chunks"``): each chunk a
read decodes is written into its shard's slot, later reads of it (in this process or
another) take it from the tier, and every value read equals the HDF5 source, whatever
the tier holds: int16-valued and true-float audio, arrays with time first or in the
middle, slots damaged or half written, values evicted, several processes at once.
Real HDF5 files written by h5py, converted, read through the public API."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import write_h5
from test_int16_shards import check_epoch

import zstore
from zstore.cache.slots import Slots
from zstore.cache.value import HEADER_SIZE
from zstore.errors import ConfigError
from zstore.format import Span
from zstore.read.reader import WindowReader

RATES = {"wav": 16000, "act": 100, "spec": 100}


def _recording(rng: np.random.Generator, seconds: float, kind: str) -> dict[str, np.ndarray]:
    n = int(seconds * 16000)
    if kind == "int16":  # 16-bit PCM read as float32 (x / 32768)
        wav = rng.integers(-32768, 32768, size=(2, n), dtype=np.int16).astype(np.float32) / 32768
    else:  # processed audio: true float values
        wav = rng.standard_normal((2, n)).astype(np.float32) * 0.1
    frames = n // 160
    return {
        "wav": wav,
        "act": (rng.random((2, frames)) > 0.5).astype(np.float32),
        # time in the middle: (channels, frames, bins)
        "spec": rng.standard_normal((2, frames, 5)).astype(np.float32),
    }


def _store(tmp_path: Path, kind: str, items: int = 3) -> tuple[str, dict[str, dict]]:
    rng = np.random.default_rng(11)
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = {f"rec{i}": _recording(rng, 70.0 + 9 * i, kind) for i in range(items)}
    h5 = write_h5(tmp_path / f"{kind}.h5", data)
    dst = tmp_path / f"{kind}.zarr"
    zstore.convert(
        h5,
        dst,
        rates=RATES,
        time_axis={"spec": 1},
        workers=1,
        progress=False,
        pack_seconds=0,
    )
    return str(dst), data


def _cache(tmp_path: Path, ram_bytes: str = "256MB", fmt: str = "chunks") -> zstore.CacheConfig:
    return zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes=ram_bytes, ram_format=fmt, ssd_dir=None
    )


def _dataset(store: str, cache: zstore.CacheConfig | bool) -> zstore.WindowDataset:
    return zstore.WindowDataset(
        store,
        window_seconds=7.0,
        seed=3,
        windows_per_item=4,
        cache=cache,
        fields=["wav", "act", "spec"],
    )


def _ram(cache: zstore.CacheConfig) -> dict:
    return zstore.cache_stats(cache)["ram"]


@pytest.mark.parametrize("kind", ["int16", "float"])
def test_reads_fill_the_tier_and_later_reads_take_it_from_there(tmp_path, kind):
    store, data = _store(tmp_path, kind)
    cache = _cache(tmp_path)
    ds = _dataset(store, cache)
    check_epoch(ds, data, 0)
    first = _ram(cache)
    assert first["fills"] > 0 and first["corrupt"] == 0
    check_epoch(ds, data, 0)  # the same windows: the tier's chunks, and the first
    second = _ram(cache)  # read's (it wrote nothing) decoded and written now
    assert second["hits"] > first["hits"] and second["misses"] - first["misses"] <= 5
    check_epoch(ds, data, 0)  # every chunk from the tier
    again = _ram(cache)
    assert again["misses"] == second["misses"] and again["hits"] > second["hits"]
    check_epoch(ds, data, 1)
    assert ds.settle(timeout=120)
    assert _ram(cache)["corrupt"] == 0


def test_int16_samples_take_half_the_bytes_true_float_its_own(tmp_path):
    """A chunk of int16 samples is written as the samples; true float audio as float32."""
    sizes = {}
    for kind in ("int16", "float"):
        store, data = _store(tmp_path / kind, kind, items=1)
        cache = _cache(tmp_path / kind)
        reader = WindowReader(store, cache=cache, fields=["wav"])
        reader.start_builds()  # no first-read hold: fill from this read on
        reader.read("rec0", {"wav": Span(0, 64 * 16000)})
        sizes[kind] = _ram(cache)["fill_bytes"]
        got = reader.read("rec0", {"wav": Span(0, 64 * 16000)})["wav"]
        assert np.array_equal(
            got.view(np.uint32), data["rec0"]["wav"][:, : 64 * 16000].view(np.uint32)
        )
    assert sizes["int16"] == 2 * 64 * 16000 * 2  # 2 channels, 64 s, int16
    assert sizes["float"] == 2 * sizes["int16"]


def test_auto_takes_chunks_for_a_local_store_whatever_the_budget(tmp_path):
    """A store read by ranges: decoded data filled by the reads, whether it fits the
    budget or a share of it stays resident (the compressed form's choice is
    tests/cache/test_budget.py's)."""
    store, data = _store(tmp_path, "int16", items=1)
    fits = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="256MB", ssd_dir=None)
    chosen = WindowReader(store, cache=fits).open().format_choice
    assert chosen is not None and chosen.format == "chunks" and "by ranges" in chosen.reason
    assert "fits the RAM budget" in chosen.reason
    share = zstore.CacheConfig(ram_dir=tmp_path / "ram2", ram_bytes="2MB", ssd_dir=None)
    chosen = WindowReader(store, cache=share).open().format_choice
    assert chosen is not None and chosen.format == "chunks" and "stays resident" in chosen.reason
    with pytest.raises(ConfigError, match="'chunks'"):
        zstore.CacheConfig(ram_format="chunk").resolved()


def test_the_first_read_writes_nothing_and_a_later_read_of_its_chunks_does(tmp_path):
    """A fresh job's first read is served as with no tier: it writes no slot (and nothing
    is queued to decode its chunks again).  The reads after it write what they decode;
    the first read's chunks are written when they are read again."""
    store, data = _store(tmp_path, "int16", items=1)
    cache = _cache(tmp_path)
    reader = WindowReader(store, cache=cache, fields=["wav"])
    first = reader.read("rec0", {"wav": Span(0, 5 * 16000)})["wav"]
    assert np.array_equal(first, data["rec0"]["wav"][:, : 5 * 16000])
    assert reader.settle(timeout=120)
    assert _ram(cache)["fills"] == 0
    reader.read("rec0", {"wav": Span(10 * 16000, 15 * 16000)})
    filled = _ram(cache)["fills"]
    assert filled > 0
    reader.read("rec0", {"wav": Span(0, 5 * 16000)})  # the first read's chunks, again
    assert _ram(cache)["fills"] > filled
    misses = _ram(cache)["misses"]
    again = reader.read("rec0", {"wav": Span(0, 5 * 16000)})["wav"]
    assert _ram(cache)["misses"] == misses
    assert np.array_equal(again, first)


def _slot_file(cache: zstore.CacheConfig) -> list[Path]:
    files = sorted(Path(cache.ram_dir).rglob("*.val"), key=lambda p: p.stat().st_size)
    assert files
    return files


def test_a_damaged_slot_is_read_as_absent_and_written_again(tmp_path):
    """Bytes of a written slot changed in the tier (or a writer killed after its bytes
    but before its presence byte): another process does not use them; it decodes the
    chunk, writes the slot again, and reads the stored values."""
    store, data = _store(tmp_path, "int16", items=1)
    cache = _cache(tmp_path)
    first = WindowReader(store, cache=cache, fields=["wav"])
    first.start_builds()
    first.read("rec0", {"wav": Span(0, 64 * 16000)})
    for path in _slot_file(cache):  # flip a byte in the middle of every value's data
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(HEADER_SIZE + (size - HEADER_SIZE) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    other = WindowReader(store, cache=cache, fields=["wav"])  # checks the slots afresh
    other.start_builds()
    for _ in range(2):
        got = other.read("rec0", {"wav": Span(0, 64 * 16000)})["wav"]
        want = data["rec0"]["wav"][:, : 64 * 16000]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    third = WindowReader(store, cache=cache, fields=["wav"])  # the slot was written again
    before = _ram(cache)["misses"]
    got = third.read("rec0", {"wav": Span(0, 64 * 16000)})["wav"]
    assert np.array_equal(got.view(np.uint32), data["rec0"]["wav"][:, : 64 * 16000].view(np.uint32))
    assert _ram(cache)["misses"] == before


def test_a_slot_without_its_presence_byte_is_not_read():
    """The order a writer follows (bytes, crc, presence byte): a slot whose presence
    byte is not set is absent, whatever its bytes and crc say."""
    n, data_nbytes = 4, 4 * 4096
    from zstore.cache.slots import slots_nbytes

    payload = bytearray(slots_nbytes(n, data_nbytes))
    slots = Slots(memoryview(payload), n, data_nbytes)
    ranges = [(4096, 4096)]
    assert not slots.has(1, ranges)
    payload[-data_nbytes + 4096 : -data_nbytes + 8192] = b"\x07" * 4096  # bytes, no presence
    assert not slots.has(1, ranges)
    with pytest.raises(ValueError):
        Slots(memoryview(payload)[:-1], n, data_nbytes)


def test_values_evicted_under_a_small_budget_read_the_stored_values(tmp_path):
    store, data = _store(tmp_path, "int16")
    cache = _cache(tmp_path, ram_bytes="9MB")  # two or three shards of the store
    ds = _dataset(store, cache)
    for epoch in (0, 1, 2, 0):
        check_epoch(ds, data, epoch)
    assert ds.settle(timeout=120)
    stats = _ram(cache)
    assert stats["corrupt"] == 0 and stats["hits"] > 0
    assert stats["bytes_on_disk"] <= 9 * 10**6


def odd_store(tmp_path: Path) -> tuple[str, dict[str, dict]]:
    """A store of one 70 s recording whose manifest says ``wav`` holds int16 samples,
    with one value that is not one (3 s in)."""
    from test_int16_shards import _claim_int16

    rng = np.random.default_rng(9)
    data = {"rec0": _recording(rng, 70.0, "int16")}
    data["rec0"]["wav"][1, 3 * 16000 + 17] = 0.25 / 32768
    h5 = write_h5(tmp_path / "odd.h5", {k: {"wav": v["wav"]} for k, v in data.items()})
    store = str(tmp_path / "odd.zarr")
    zstore.convert(h5, store, rates={"wav": 16000}, workers=1, progress=False, pack_seconds=0)
    _claim_int16(store)
    return store, data


def test_values_that_are_not_samples_are_never_written_and_read_right(tmp_path, caplog):
    """The manifest says int16 samples, one value is not one: its chunk stays out of the
    tier (decoded each time), said once; every value reads as stored."""
    store, data = odd_store(tmp_path)
    cache = _cache(tmp_path)
    reader = WindowReader(store, cache=cache, fields=["wav"])
    reader.start_builds()
    with caplog.at_level(logging.WARNING, logger="zstore"):
        for _ in range(3):
            got = reader.read("rec0", {"wav": Span(0, 70 * 16000)})["wav"]
            assert np.array_equal(got.view(np.uint32), data["rec0"]["wav"].view(np.uint32))
    said = [r for r in caplog.records if "not int16 samples" in r.getMessage()]
    assert len(said) == 1
    stats = _ram(cache)
    assert stats["misses"] >= 3 and stats["hits"] > 0  # that chunk decoded every time


def _reader_process(store: str, cache: zstore.CacheConfig, barrier, queue, order: int) -> None:
    reader = WindowReader(store, cache=cache, fields=["wav", "act", "spec"])
    reader.start_builds()
    barrier.wait()  # both opened
    if order == 1:
        barrier.wait()  # the first one has read
    before = zstore.cache_stats(cache)["ram"]
    got = reader.read(
        "rec1", {"wav": Span(0, 60 * 16000), "act": Span(0, 6000), "spec": Span(0, 6000)}
    )
    stats = zstore.cache_stats(cache)["ram"]
    stats = {k: stats[k] - before[k] for k in ("hits", "misses", "fills")}
    queue.put((order, {k: v for k, v in got.items()}, stats))
    if order == 0:
        barrier.wait()


def test_another_process_reads_the_chunks_one_wrote(tmp_path):
    """Two spawned processes on one node: the second reads the chunks the first wrote
    (hits, no decoding) and both read the source's values."""
    store, data = _store(tmp_path, "int16")
    cache = _cache(tmp_path)
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2, timeout=300), ctx.Queue()
    procs = [
        ctx.Process(target=_reader_process, args=(store, cache, barrier, queue, i))
        for i in range(2)
    ]
    for p in procs:
        p.start()
    reports = [queue.get(timeout=300) for _ in range(2)]
    got = {order: arrays for order, arrays, _ in reports}
    assert reports and all(p for p in reports)
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    for order in (0, 1):
        assert np.array_equal(
            got[order]["wav"].view(np.uint32), data["rec1"]["wav"][:, : 60 * 16000].view(np.uint32)
        )
        assert np.array_equal(got[order]["spec"], data["rec1"]["spec"][:, :6000])
    counted = {order: stats for order, _, stats in reports}
    assert counted[0]["hits"] == 0 and counted[0]["misses"] > 0  # the first decoded
    assert counted[1]["misses"] == 0 and counted[1]["hits"] == counted[0]["misses"]
    assert _ram(cache)["corrupt"] == 0


def test_warm_writes_every_chunk_and_a_read_after_it_decodes_nothing(tmp_path):
    store, data = _store(tmp_path, "int16")
    cache = _cache(tmp_path)
    zstore.warm(store, cache=cache, fields=["wav", "act", "spec"], workers=1, progress=False)
    before = _ram(cache)["misses"]
    ds = _dataset(store, cache)
    check_epoch(ds, data, 0)
    assert _ram(cache)["misses"] == before


def test_shards_mostly_read_are_completed_behind_the_reads(tmp_path):
    """Once most of a shard's chunks are in the tier, the rest are decoded and written
    behind the reads: after settle(), windows anywhere in it decode nothing."""
    store, data = _store(tmp_path, "int16", items=1)
    cache = _cache(tmp_path)
    reader = WindowReader(store, cache=cache, fields=["wav"])
    reader.start_builds()
    reader.read("rec0", {"wav": Span(0, 56 * 16000)})  # 56 of the first shard's 64 s
    reader.read("rec0", {"wav": Span(0, 16000)})  # finds most of it in the tier
    assert reader.settle(timeout=120)
    before = _ram(cache)["misses"]
    got = reader.read("rec0", {"wav": Span(58 * 16000, 63 * 16000)})["wav"]
    assert np.array_equal(
        got.view(np.uint32), data["rec0"]["wav"][:, 58 * 16000 : 63 * 16000].view(np.uint32)
    )
    assert _ram(cache)["misses"] == before


def test_packed_short_items_keep_whole_shards_and_read_right_as_chunks(packed_store, tmp_path):
    """Short items packed together are read a batch at a time out of whole decoded
    shards: ``auto`` keeps that form for them.  Asked for, the form the reads fill reads
    their windows right too."""
    fits = zstore.CacheConfig(ram_dir=tmp_path / "auto", ram_bytes="256MB", ssd_dir=None)
    chosen = WindowReader(packed_store, cache=fits).open().format_choice
    assert chosen is not None and chosen.format == "decoded"
    ref = zstore.WindowDataset(packed_store, window_seconds=0.5, seed=1, cache=False)
    ds = zstore.WindowDataset(packed_store, window_seconds=0.5, seed=1, cache=_cache(tmp_path))
    for epoch in (0, 0, 1):
        ref.set_epoch(epoch)
        ds.set_epoch(epoch)
        for i in range(len(ds)):
            got, want = ds[i], ref[i]
            for name, value in want.items():
                if hasattr(value, "numpy"):
                    assert np.array_equal(got[name].numpy(), value.numpy()), (epoch, i, name)
    assert _ram(_cache(tmp_path))["hits"] > 0
