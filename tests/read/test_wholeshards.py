"""Whole shard objects in the SSD tier: filled by warm and fetch="shard", read by slicing a
map, checked, and dropped when corrupt."""

from __future__ import annotations

import os
import sqlite3
import threading

import numpy as np
import pytest
import zarr

import zstore
from zstore.format.layout import Span
from zstore.read.reader import WindowReader
from zstore.testing import ModelledFileSystem


def ssd_only(tmp_path, **kw):
    return zstore.CacheConfig(
        **{
            **dict(
                ram_dir=None, ram_bytes=0, ssd_dir=tmp_path / "ssd", ssd_bytes="64MB", fetch="range"
            ),
            **kw,
        }
    )


def ram_and_ssd(tmp_path, **kw):
    """Both tiers, with shards fetched whole (``kw`` overrides)."""
    return zstore.CacheConfig(
        **{
            **dict(
                ram_dir=tmp_path / "ram",
                ram_bytes="64MB",
                ssd_dir=tmp_path / "ssd",
                ssd_bytes="64MB",
                fetch="shard",
            ),
            **kw,
        }
    )


def tier_keys(directory):
    with sqlite3.connect(directory / "cache.db") as db:
        return [k for (k,) in db.execute("SELECT key FROM Cache")]


def windows(root, item, rng, n=8):
    length = root[f"{item}/act"].shape[-1]
    out = [(0, length), (max(0, length - 7), length)]
    for _ in range(n):
        a = int(rng.integers(0, length))
        out.append((a, int(rng.integers(a, length + 1))))
    return out


def assert_windows_equal(reader, root, rng):
    for item in sorted(root.group_keys()):
        for a, b in windows(root, item, rng):
            got = reader.read(item, {"act": Span(a, b), "wav": Span(a * 160, b * 160)})
            np.testing.assert_array_equal(got["act"], root[f"{item}/act"][:, a:b])
            np.testing.assert_array_equal(got["wav"], root[f"{item}/wav"][:, a * 160 : b * 160])


def test_warm_keeps_whole_shards_and_windows_need_no_origin_request(small_store, tmp_path):
    cfg = ssd_only(tmp_path)
    zstore.warm(small_store, cache=cfg, progress=False, workers=2)
    keys = tier_keys(tmp_path / "ssd")
    root = zarr.open_group(small_store, mode="r")
    shards = [k for k in keys if k.endswith("#W")]
    arrays = {k.split("/", 1)[1].rsplit("/c/", 1)[0] for k in shards}
    assert arrays == {f"{item}/{name}" for item in root.group_keys() for name in ("act", "wav")}
    assert not [k for k in keys if "#r" in k]  # no chunk values next to the whole shards
    fs = ModelledFileSystem()
    reader = WindowReader(small_store, cache=cfg, origin_fs=fs).open()  # another process
    fs.reset_counts()
    assert_windows_equal(reader, root, np.random.default_rng(0))
    assert fs.data_requests == 0
    assert zstore.cache_stats(cfg)["ssd"]["hits"] > 0


@pytest.mark.parametrize("where", ["chunks", "index"])
def test_a_corrupt_whole_shard_is_dropped_and_its_windows_read_right(small_store, tmp_path, where):
    cfg = ssd_only(tmp_path)
    zstore.warm(small_store, cache=cfg, progress=False, workers=1)
    files = sorted((tmp_path / "ssd").rglob("*.val"), key=lambda f: f.stat().st_size)
    big = [f for f in files if f.stat().st_size > 100_000]
    assert big
    for f in big:
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2 if where == "chunks" else len(raw) - 10] ^= 0x01  # one bit
        f.write_bytes(bytes(raw))
    root = zarr.open_group(small_store, mode="r")
    reader = WindowReader(small_store, cache=cfg)  # maps the files as another process
    for item in sorted(root.group_keys()):
        wav = root[f"{item}/wav"]
        np.testing.assert_array_equal(
            reader.read(item, {"wav": Span(0, wav.shape[1])})["wav"], wav[...]
        )
    assert zstore.cache_stats(cfg)["ssd"]["corrupt"] >= 1
    assert not any(f.exists() for f in big)  # dropped, not read again
    assert_windows_equal(WindowReader(small_store, cache=cfg), root, np.random.default_rng(1))


def test_shard_fetch_fills_each_whole_shard_once_for_the_node(small_store, tmp_path):
    cfg = ssd_only(tmp_path, fetch="shard")
    root = zarr.open_group(small_store, mode="r")
    item = "utt000004"
    wav = root[f"{item}/wav"]
    fs = ModelledFileSystem()
    first = WindowReader(small_store, cache=cfg, origin_fs=fs).open()
    second = WindowReader(small_store, cache=cfg, origin_fs=fs).open()
    fs.reset_counts()
    got = first.read(item, {"wav": Span(0, 16000)})["wav"]
    np.testing.assert_array_equal(got, wav[:, :16000])
    assert fs.data_requests == 1  # the whole shard, no index request
    got = second.read(item, {"wav": Span(16000, wav.shape[1])})["wav"]
    np.testing.assert_array_equal(got, wav[:, 16000:])
    assert fs.data_requests == 1  # the second reader maps what the first kept
    assert first.settle(timeout=120)  # its write of the shard, behind its read
    assert [k for k in tier_keys(tmp_path / "ssd") if "#r" in k or "#s" in k] == []
    assert zstore.cache_stats(cfg)["ssd"]["fills"] == 1


def test_whole_shards_serve_the_decoded_and_encoded_ram_tiers(small_store, tmp_path):
    root = zarr.open_group(small_store, mode="r")
    for fmt in ("decoded", "encoded"):
        ssd = ssd_only(tmp_path / fmt)
        zstore.warm(small_store, cache=ssd, progress=False, workers=1)
        cfg = zstore.CacheConfig(
            ram_dir=tmp_path / fmt / "ram",
            ram_bytes="64MB",
            ram_format=fmt,
            ssd_dir=tmp_path / fmt / "ssd",
            ssd_bytes="64MB",
            fetch="range",
        )
        fs = ModelledFileSystem()
        reader = WindowReader(small_store, cache=cfg, origin_fs=fs).open()
        fs.reset_counts()
        for _ in range(2):  # builds the RAM tier's shards from the SSD's, then hits
            assert_windows_equal(reader, root, np.random.default_rng(2))
        assert fs.data_requests == 0


def test_a_read_does_not_wait_for_another_process_fetching_its_shard_whole(small_store, tmp_path):
    """With ``fetch="shard"``, while another process holds the node's lock to fetch a
    shard whole, a read of one of its windows takes the window's ranges instead of
    waiting; once the lock is free, the next read fetches and keeps the shard whole."""
    cfg = zstore.CacheConfig(
        ram_dir=None, ssd_dir=tmp_path / "ssd", ssd_bytes="256MB", fetch="shard"
    )
    item = "utt000003"
    wav = zarr.open_group(small_store, mode="r")[f"{item}/wav"]
    shard = os.path.getsize(f"{small_store}/{item}/wav/c/0/0")
    fs = ModelledFileSystem()
    reader = WindowReader(small_store, cache=cfg, origin_fs=fs).open()
    other = WindowReader(small_store, cache=cfg).open()  # as the process fetching it
    key = other.source.whole.key(reader.layout(item, "wav").object_key(0))
    held = other.tiers.fill_locks.acquire([key])
    fs.reset_counts()
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(reader.read(item, {"wav": Span(0, 16000)})))
    t.start()
    t.join(120)
    other.tiers.fill_locks.release(held)
    assert not t.is_alive(), "the read waited for the other process's whole-shard fetch"
    np.testing.assert_array_equal(got["wav"], wav[:, :16000])
    assert 0 < fs.data_bytes < shard  # the index and the window's chunk, not the shard

    fs.reset_counts()
    again = reader.read(item, {"wav": Span(16000, 48000)})["wav"]
    np.testing.assert_array_equal(again, wav[:, 16000:48000])
    assert fs.data_bytes == shard and fs.data_requests == 1  # now fetched whole, once


def test_ranges_read_around_a_shard_fetched_whole_are_neither_locked_nor_kept(
    small_store, tmp_path, every_stripe_held
):
    """While another process fetches a shard whole for the SSD tier, a read takes its
    window's ranges past the tiers: no node lock to wait for (the locks are striped,
    so a batch's ranges waited for other processes' unrelated fetches) and no SSD value
    of their own beside the whole shard."""
    cfg = zstore.CacheConfig(
        ram_dir=None, ssd_dir=tmp_path / "ssd", ssd_bytes="256MB", fetch="shard"
    )
    item = "utt000003"
    wav = zarr.open_group(small_store, mode="r")[f"{item}/wav"]
    reader = WindowReader(small_store, cache=cfg).open()
    every_stripe_held(reader.tiers.fill_locks)  # every shard is being fetched whole
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(reader.read(item, {"wav": Span(0, 48000)})))
    t.start()
    t.join(120)
    assert not t.is_alive(), "the read waited for a node lock"
    np.testing.assert_array_equal(got["wav"], wav[:, :48000])
    assert zstore.cache_stats(cfg)["ssd"]["fills"] == 0


def test_a_shard_fetched_whole_is_written_behind_the_read(small_store, tmp_path, hold):
    """The read that fetches a shard whole returns before the shard is written to the
    SSD tier: the write runs behind the reads with the node's lock for the shard, this
    process reads the shard from memory meanwhile, and ``settle`` waits for it."""
    from zstore.read._ssd_shards import WholeShards

    started, release = hold(WholeShards, "put")  # a read writing it would wait here
    cfg = ssd_only(tmp_path, fetch="shard")
    item = "utt000005"
    wav = zarr.open_group(small_store, mode="r")[f"{item}/wav"]
    fs = ModelledFileSystem()
    reader = WindowReader(small_store, cache=cfg, origin_fs=fs).open()
    fs.reset_counts()
    try:
        got = reader.read(item, {"wav": Span(0, 16000)})["wav"]  # returns, write held
        assert started.wait(120)
        np.testing.assert_array_equal(got, wav[:, :16000])
        assert zstore.cache_stats(cfg)["ssd"]["fills"] == 0
        later = reader.read(item, {"wav": Span(16000, 32000)})["wav"]
        np.testing.assert_array_equal(later, wav[:, 16000:32000])
        assert fs.data_requests == 1  # the whole shard once; the later window from memory
    finally:
        release.set()
    assert reader.settle(timeout=120)
    assert zstore.cache_stats(cfg)["ssd"]["fills"] == 1
    fresh = WindowReader(small_store, cache=cfg, origin_fs=fs).open()
    fs.reset_counts()
    np.testing.assert_array_equal(fresh.read(item, {"wav": Span(0, 16000)})["wav"], got)
    assert fs.data_requests == 0  # mapped from the SSD tier


def test_whole_shard_writes_do_not_hold_up_the_ram_fills(small_store, tmp_path, hold):
    """The SSD writes of shards fetched whole have a queue and thread of their own: while
    they wait, the RAM tier's fill of the same shard goes ahead, from the object in
    memory (sharing one queue, the writes held the fills back into later epochs)."""
    from zstore.read._ssd_shards import WholeShards

    # held before it takes the fork gate, as a slow disk would hold it
    started, release = hold(WholeShards, "_write")
    cfg = ram_and_ssd(tmp_path)
    item = "utt000001"
    wav = zarr.open_group(small_store, mode="r")[f"{item}/wav"]
    reader = WindowReader(small_store, cache=cfg).open()
    reader.start_builds()  # past its first read, which asks for no RAM fill
    try:
        got = reader.read(item, {"wav": Span(0, 16000)})["wav"]
        assert started.wait(120)
        assert reader.behind.wait(timeout=120)  # the RAM fill, while the write waits
        stats = zstore.cache_stats(cfg)
        assert stats["ssd"]["fills"] == 0
        assert stats["ram"]["fills"] >= 1
    finally:
        release.set()
    assert reader.settle(timeout=120)
    assert zstore.cache_stats(cfg)["ssd"]["fills"] == 1
    np.testing.assert_array_equal(got, wav[:, :16000])


def test_ranges_around_other_fetches_are_read_while_this_ones_run(small_store, tmp_path):
    """One read's shards that another process is fetching whole (read by ranges around
    them) and those this process fetches whole go to the origin at once, not one after
    the other: the whole fetch here waits until the ranges are in, which, fetched
    after it (as they were), would never be."""
    from zstore.read._chunks import ChunkSource
    from zstore.read._whole_fetch import WholeFetch

    cfg = zstore.CacheConfig(
        ram_dir=None, ssd_dir=tmp_path / "ssd", ssd_bytes="256MB", fetch="shard"
    )
    around, mine = "utt000003", "utt000004"
    root = zarr.open_group(small_store, mode="r")
    reader = WindowReader(small_store, cache=cfg).open()
    other = WindowReader(small_store, cache=cfg).open()  # as the process fetching one
    layouts = {item: reader.layout(item, "wav") for item in (around, mine)}
    held = other.tiers.fill_locks.acquire([other.source.whole.key(layouts[around].object_key(0))])
    ranges_in, order = threading.Event(), []
    real_fetch, real_many = WholeFetch.fetch, ChunkSource.fetch_many

    def fetch(self, todo, locks):
        order.append(("whole", sorted(todo), ranges_in.wait(120)))
        return real_fetch(self, todo, locks)

    def fetch_many(self, keys, *args, **kwargs):
        got = real_many(self, keys, *args, **kwargs)
        if any("#r" in k for k in keys):
            order.append(("ranges", sorted(k.split("#")[0] for k in keys), True))
            ranges_in.set()
        return got

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(WholeFetch, "fetch", fetch)
            mp.setattr(ChunkSource, "fetch_many", fetch_many)
            need = [(layouts[around], 1), (layouts[mine], 0), (layouts[mine], 2)]
            got = reader.source.raw(need, ram=False)
    finally:
        other.tiers.fill_locks.release(held)
    assert order == [
        ("ranges", [layouts[around].object_key(0)], True),
        ("whole", [layouts[mine].object_key(0)], True),
    ] or order == [
        ("whole", [layouts[mine].object_key(0)], True),
        ("ranges", [layouts[around].object_key(0)], True),
    ]
    chunk = layouts[mine].chunk
    for (layout, k), (request, data) in zip(need, got):
        item = around if layout is layouts[around] else mine
        want = root[f"{item}/wav"][:, k * chunk : (k + 1) * chunk]
        decoded = reader.source.decode(layout, request, data)
        np.testing.assert_array_equal(decoded[:, : want.shape[1]], want)
    assert reader.settle(timeout=120)
    assert reader.source.whole.held(layouts[mine], layouts[mine].object_key(0), [0]) is not None


def test_an_encoded_first_read_fetches_each_shard_whole_once(small_store, tmp_path):
    """With ``fetch="shard"`` and the encoded RAM form, admission weighs a shard by its
    index: that index is read by its own range, and the shard object is fetched whole
    once, by the read (an index miss used to fetch its object whole too, and put every
    chunk in the tiers, before the read fetched the object whole again: a 4-rank first
    batch on an S3-like origin spent 0.45-0.77 s on it)."""
    fs = ModelledFileSystem()
    cfg = ram_and_ssd(tmp_path, ram_format="encoded", ssd_bytes="256MB")
    reader = WindowReader(small_store, cache=cfg, origin_fs=fs).open()
    reader.start_builds()  # past its first read, which asks no admission
    item = "utt000002"
    objects = [f"{small_store}/{item}/{name}/c/0/0" for name in ("wav", "act")]
    fs.reset_counts()
    got = reader.read(item, {"act": Span(100, 300), "wav": Span(16000, 48000)})
    layouts = [reader.layout(item, name) for name in ("wav", "act")]
    whole = sum(os.path.getsize(o) for o in objects)
    assert fs.data_bytes == whole + sum(layout.index_bytes for layout in layouts)
    root = zarr.open_group(small_store, mode="r")
    np.testing.assert_array_equal(got["wav"], root[f"{item}/wav"][:, 16000:48000])
    np.testing.assert_array_equal(got["act"], root[f"{item}/act"][:, 100:300])
    assert reader.settle(timeout=120)


@pytest.mark.parametrize("room", [True, False])
def test_a_ram_fill_takes_a_shard_fetched_whole_from_memory(
    small_store, tmp_path, hold, monkeypatch, room
):
    """The read that fetches a shard whole hands its other chunks to the RAM fill from
    memory: a fill that starts after the shard's SSD write finished does not read it
    back from the SSD tier (written around the page cache, that is a device read), and
    nor do this process's reads of it until the fill is done.  Those bytes are bounded
    (MAX_AT_HAND_BYTES) and given back when the fill is done; past the bound the fill
    and the reads read the shard from the SSD tier, as they did before."""
    from zstore.read._ram_shards import ShardForm
    from zstore.read._ssd_shards import _AT_HAND, WholeShards

    fill_started, fill_release = hold(ShardForm, "_finish_builds")
    written = threading.Event()
    real_write = WholeShards._write

    def write(self, *args, **kwargs):
        try:
            return real_write(self, *args, **kwargs)
        finally:
            written.set()

    monkeypatch.setattr(WholeShards, "_write", write)
    cfg = ram_and_ssd(tmp_path)
    item = "utt000003"
    wav = zarr.open_group(small_store, mode="r")[f"{item}/wav"]
    fs = ModelledFileSystem()
    reader = WindowReader(small_store, cache=cfg, origin_fs=fs).open()
    reader.start_builds()  # past its first read, which asks for no RAM fill
    budget = reader.form.at_hand
    if not room:
        budget.used = budget.limit  # other fills hold all of it
    fs.reset_counts()
    got = reader.read(item, {"wav": Span(0, 16000)})["wav"]
    assert fill_started.wait(120) and written.wait(120)  # the SSD write first, then the fill
    assert zstore.cache_stats(cfg)["ssd"]["fills"] == 1
    # a read of the shard while its fill waits: with room, from this process's memory
    # (no SSD-tier hit, which would be a device read), without, from the SSD tier
    again = reader.read(item, {"wav": Span(8000, 24000)})["wav"]
    np.testing.assert_array_equal(again, wav[:, 8000:24000])
    assert (zstore.cache_stats(cfg)["ssd"]["hits"] == 0) is room
    fill_release.set()
    assert reader.settle(timeout=120)
    assert not _AT_HAND  # let go once both the SSD write and the fill are done
    stats = zstore.cache_stats(cfg)
    assert stats["ram"]["fills"] >= 1
    # with room the fill did not map the SSD tier's copy; without, it read it from there
    assert (stats["ssd"]["hits"] == 0) is room
    assert budget.used == (0 if room else budget.limit)  # what the fill took, given back
    assert fs.data_requests == 1  # nor did it fetch anything again
    np.testing.assert_array_equal(got, wav[:, :16000])
    hits = stats["ssd"]["hits"]
    whole = reader.read(item, {"wav": Span(0, wav.shape[1])})["wav"]  # from the RAM tier
    np.testing.assert_array_equal(whole, wav[:])
    assert zstore.cache_stats(cfg)["ssd"]["hits"] == hits


def test_a_windows_chunks_in_a_shard_held_whole_are_not_counted_twice(small_store, tmp_path, hold):
    """A window's chunks taken from a shard object fetched whole are part of that object,
    which its fill holds within MAX_AT_HAND_BYTES: they are not counted again in the
    fills queue's bytes.  Counted there, the next batch's fills found the queue full
    behind the batch before it, and their shards were read again from the SSD tier."""
    from zstore.read._ram_shards import ShardForm
    from zstore.read._ssd_shards import WholeShards

    fill_started, fill_release = hold(ShardForm, "_finish_builds")
    _, write_release = hold(WholeShards, "_write")  # the objects stay in memory meanwhile
    cfg = ram_and_ssd(tmp_path)
    root = zarr.open_group(small_store, mode="r")
    items = sorted(root.group_keys())[:3]
    fs = ModelledFileSystem()
    reader = WindowReader(small_store, cache=cfg, origin_fs=fs).open()
    reader.start_builds()  # past its first read, which asks for no RAM fill
    behind = reader.form.behind
    behind.max_bytes = 1  # a queued fill's window bytes, counted, would leave no room
    fs.reset_counts()
    got = [reader.read(item, {"wav": Span(0, 16000)})["wav"] for item in items]
    assert fill_started.wait(120)
    assert len(behind.pending) == len(items)  # every item's fill queued, none refused
    assert behind.pending_bytes == 0
    write_release.set()
    fill_release.set()
    assert reader.settle(timeout=120)
    assert zstore.cache_stats(cfg)["ram"]["fills"] == len(items)
    assert fs.data_requests == len(items)  # each shard fetched once, whole
    for item, wav in zip(items, got):
        np.testing.assert_array_equal(wav, root[f"{item}/wav"][:, :16000])


def test_whole_shards_written_around_the_page_cache_read_back_right(
    small_store, tmp_path, monkeypatch
):
    """Whole shards of DIRECT_MIN bytes and more reach the SSD tier by direct writes (this
    store's shards are smaller: the bound is lowered here), and windows read from them
    in a fresh reader equal the store's."""
    import zstore.cache._tier_files as tier_files

    direct = []
    real = tier_files.write_direct

    def counted(path, parts, *args):
        got = real(path, parts, *args)
        direct.append(got)
        return got

    monkeypatch.setattr(tier_files, "DIRECT_MIN", 4096)
    monkeypatch.setattr(tier_files, "write_direct", counted)
    cfg = ssd_only(tmp_path, fetch="shard")
    root = zarr.open_group(small_store, mode="r")
    first = WindowReader(small_store, cache=cfg)
    assert_windows_equal(first, root, np.random.default_rng(5))
    assert first.settle(timeout=120)
    shards = [k for k in tier_keys(tmp_path / "ssd") if k.endswith("#W")]
    assert len(shards) == 2 * len(list(root.group_keys()))
    large = [
        os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(tmp_path / "ssd")
        for f in files
        if f.endswith(".val") and os.path.getsize(os.path.join(d, f)) >= 4096
    ]
    assert sorted(direct) == sorted(large)  # each large value written directly (the wav shards)
    assert len(large) == len(list(root.group_keys()))
    fs = ModelledFileSystem()
    fresh = WindowReader(small_store, cache=cfg, origin_fs=fs).open()
    fs.reset_counts()
    assert_windows_equal(fresh, root, np.random.default_rng(6))
    assert fs.data_requests == 0  # every window from the SSD tier's shards


def test_a_forked_child_holds_none_of_its_parents_shards_in_memory(small_store, tmp_path, hold):
    """A shard object the parent holds in memory (its SSD write and its fill queued) is
    not in a forked child's: the child writes and fills none of them, and reads the
    shard from the tiers or the origin."""
    from zstore.read._ram_shards import ShardForm
    from zstore.read._ssd_shards import _AT_HAND, _HOLDERS, WholeShards

    hold(ShardForm, "_finish_builds")
    _, write_release = hold(WholeShards, "_write")
    cfg = ram_and_ssd(tmp_path)
    reader = WindowReader(small_store, cache=cfg, origin_fs=ModelledFileSystem()).open()
    reader.read("utt000001", {"wav": Span(0, 16000)})
    assert _AT_HAND and _HOLDERS  # held for the queued write and the fill
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it holds, then leave at once
        os.write(write_end, bytes([len(_AT_HAND), len(_HOLDERS)]))
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        assert f.read() == bytes([0, 0])
    assert os.waitpid(pid, 0)[1] == 0
    write_release.set()
