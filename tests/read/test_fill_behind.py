"""The first touch of a shard fills the RAM tier behind the read: the window is served
from its own chunks at once, the rest of the fill runs in the reader's background
thread under the node's lock, and nothing waits for it (issue #28).  The decoded form
(``ram_format="decoded"``); the form the reads fill chunk by chunk is
tests/read/test_chunk_shards.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import zarr

import zstore
from zstore.format import Span
from zstore.read import WindowReader
from zstore.read._fill_chunks import RestFetch
from zstore.read._ram_shards import ShardForm
from zstore.testing import ModelledFileSystem

ITEM = "utt000002"
RATES = {"wav": 16000, "act": 100}
SPANS = {"wav": Span(16000, 48000), "act": Span(100, 300)}


@pytest.fixture
def held_fills(hold):
    """Fills behind the reads wait for ``release`` (set it to let them run)."""
    return hold(ShardForm, "_finish_builds")


@pytest.fixture
def rest_fetches(monkeypatch) -> list[RestFetch]:
    """Every fetch of queued fills' other chunks (:class:`RestFetch`) made meanwhile."""
    fetches: list[RestFetch] = []
    made = RestFetch.__init__

    def recorded(self):
        made(self)
        fetches.append(self)

    monkeypatch.setattr(RestFetch, "__init__", recorded)
    return fetches


@pytest.mark.parametrize("ram_format", ["decoded", "encoded"])
def test_a_read_is_served_before_its_shards_are_filled(
    small_store, tmp_path, held_fills, ram_format
):
    started, release = held_fills
    root = zarr.open_group(small_store, mode="r")
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ram_format=ram_format, ssd_dir=None
    )
    fs = ModelledFileSystem()
    reader = WindowReader(small_store, cache=cfg, origin_fs=fs).open()
    reader.start_builds()  # past its first read, which asks for no build
    fs.reset_counts()  # what opening read: the manifest and the arrays' metadata

    got = reader.read(ITEM, SPANS)  # returns while the fill is held
    assert started.wait(120)
    indexes = len(SPANS)
    np.testing.assert_array_equal(got["wav"], root[f"{ITEM}/wav"][:, 16000:48000])
    np.testing.assert_array_equal(got["act"], root[f"{ITEM}/act"][:, 100:300])
    # no shard is in the tier yet (what it holds: the two shard indexes)
    assert zstore.cache_stats(cfg)["ram"]["fills"] == indexes

    # Another process reading the same window meanwhile does not wait for the node's
    # lock the fill holds: it reads around the shards, from the chunks.
    other = WindowReader(small_store, cache=cfg).read(ITEM, SPANS)
    np.testing.assert_array_equal(other["wav"], got["wav"])
    assert zstore.cache_stats(cfg)["ram"]["fills"] == indexes

    release.set()
    assert reader.settle(timeout=120)
    stats = zstore.cache_stats(cfg)
    assert stats["ram"]["fills"] == indexes + 2  # the wav and act shards, once
    # the fill fetched the shards' other chunks: every byte of both shards, once
    assert fs.data_bytes == sum(os.path.getsize(f"{small_store}/{ITEM}/{n}/c/0/0") for n in SPANS)
    hits = stats["ram"]["hits"]
    again = reader.read(ITEM, SPANS)  # now from the shards in the tier
    np.testing.assert_array_equal(again["wav"], got["wav"])
    assert zstore.cache_stats(cfg)["ram"]["hits"] > hits


@pytest.mark.parametrize("ram_format", ["decoded", "encoded"])
def test_a_queued_fill_fetches_its_shards_at_once_and_reads_take_them_from_memory(
    small_store, tmp_path, held_fills, rest_fetches, ram_format
):
    """From a remote origin read by ranges, the rest of a shard whose fill is queued is
    fetched behind the reads at once (after the node's first reads), not by the fill in
    its turn; until the fill is done, this process's other reads of the shard take its
    chunks from memory, and the fill asks the origin for nothing.  Before, the fills
    fetched their shards one after another, still running when the next epoch began,
    and reads around them fetched their chunks again (tools/bench_cluster.py: 2-8% of
    the first epoch's bytes in the second, 1.5x the store in the first)."""
    started, release = held_fills
    root = zarr.open_group(small_store, mode="r")
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ram_format=ram_format, ssd_dir=None
    )
    fs = ModelledFileSystem()
    reader = WindowReader(small_store, cache=cfg, origin_fs=fs).open()
    reader.start_builds()  # past the node's first reads (their fills fetch in turn)
    fs.reset_counts()
    shards = sum(os.path.getsize(f"{small_store}/{ITEM}/{n}/c/0/0") for n in SPANS)

    reader.read(ITEM, SPANS)  # returns while the fill is held
    assert started.wait(120) and rest_fetches
    assert all(f.done.wait(120) for f in rest_fetches)  # fetched while the fill waits its turn
    assert fs.data_bytes == shards  # both shards: their indexes and all their chunks
    requests = fs.data_requests
    whole = {n: Span(0, root[f"{ITEM}/{n}"].shape[-1]) for n in SPANS}
    got = reader.read(ITEM, whole)  # every chunk, the fill still held
    assert fs.data_requests == requests  # all from the fill's memory
    for name in SPANS:
        np.testing.assert_array_equal(got[name], root[f"{ITEM}/{name}"][...])

    release.set()
    assert reader.settle(timeout=120)
    assert (fs.data_requests, fs.data_bytes) == (requests, shards)  # the fill fetched nothing
    assert zstore.cache_stats(cfg)["ram"]["fills"] == len(SPANS) * 2  # indexes, shards
    assert len(reader.form.fill_chunks) == 0  # let go once the shards are in
    assert reader.form.at_hand.used == 0  # and their bytes given back
    hits = zstore.cache_stats(cfg)["ram"]["hits"]
    again = reader.read(ITEM, whole)
    for name in SPANS:
        np.testing.assert_array_equal(again[name], got[name])
    assert zstore.cache_stats(cfg)["ram"]["hits"] > hits and fs.data_requests == requests


def test_a_chunk_never_written_takes_nothing_of_the_at_hand_budget(
    small_store, tmp_path, held_fills, rest_fetches
):
    """A store of another writer leaves chunks of fill values out of a shard (zarr's
    default); the fetch of a queued fill's other chunks counts what it fetches against
    the process's at-hand bytes, and such a chunk fetches nothing, so it counts nothing
    (it counted its decoded size)."""
    from conftest import edit_header

    started, release = held_fills
    store = tmp_path / "other.zarr"
    shutil.copytree(small_store, store)
    edit_header(store, lambda h: {k: v for k, v in h.items() if k != "all_chunks_written"})
    wav = zarr.open_array(str(store / ITEM / "wav"), mode="r+")
    step = wav.chunks[-1]
    wav[:, (wav.shape[-1] - 1) // step * step :] = 0  # the last chunk: left out by zarr
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ram_format="decoded", ssd_dir=None
    )
    reader = WindowReader(str(store), cache=cfg, origin_fs=ModelledFileSystem()).open()
    reader.start_builds()

    got = reader.read(ITEM, SPANS)
    assert started.wait(120) and rest_fetches
    assert all(f.done.wait(120) for f in rest_fetches)
    got_back = {key: r for f in rest_fetches for key, r in f.got.items()}
    last = (f"{ITEM}/wav", (wav.shape[-1] - 1) // step)
    assert got_back[last] == (None, None)  # fetched with the rest: nothing to fetch
    fetched = sum(len(data) for _, data in got_back.values() if data is not None)
    assert sum(f.nbytes for f in rest_fetches) == fetched
    release.set()
    assert reader.settle(timeout=120)
    assert reader.form.at_hand.used == 0
    whole = reader.read(ITEM, {"wav": Span(0, wav.shape[-1])})["wav"]
    np.testing.assert_array_equal(whole, wav[...])
    np.testing.assert_array_equal(got["wav"], wav[:, SPANS["wav"].start : SPANS["wav"].stop])


def test_a_fill_that_fails_lets_go_of_its_chunks(small_store, tmp_path, monkeypatch, caplog):
    """A fill that fails leaves its shard out of the tier and drops the chunks it held
    for this process's reads; the next read fetches them again and gets the values."""
    root = zarr.open_group(small_store, mode="r")
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ram_format="decoded", ssd_dir=None
    )
    fs = ModelledFileSystem()
    reader = WindowReader(small_store, cache=cfg, origin_fs=fs).open()
    reader.start_builds()  # past its first read, which asks for no build

    def broken(self, *args, **kwargs):
        raise OSError("the tier's disk is gone")

    monkeypatch.setattr(type(reader.form), "fill", broken)
    first = reader.read(ITEM, SPANS)
    assert reader.settle(timeout=120)
    assert "behind the reads failed" in caplog.text
    assert len(reader.form.fill_chunks) == 0
    requests = fs.data_requests
    again = reader.read(ITEM, SPANS)
    assert fs.data_requests > requests  # from the origin again, not from memory
    for name in SPANS:
        np.testing.assert_array_equal(again[name], first[name])
        np.testing.assert_array_equal(
            first[name], root[f"{ITEM}/{name}"][:, SPANS[name].start : SPANS[name].stop]
        )


@pytest.fixture
def live_process():
    """A process that stays alive until the test ends (it waits on its stdin)."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    yield child
    child.stdin.close()
    child.wait(120)


def test_builds_wait_for_the_other_processes_first_reads(small_store, tmp_path, live_process):
    """A process's fills wait for its own first read (which asks for none) and for the
    first reads the node's other processes have running (each marks itself under the
    RAM tier's ``starting`` directory): with 4 ranks, the ranks served first filled
    beside the others' first batches, and the slowest first batch took ~1.4x as long as
    with no tiers."""
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ram_format="decoded", ssd_dir=None
    )
    starting = tmp_path / "ram" / "starting"
    starting.mkdir(parents=True)
    (starting / str(live_process.pid)).touch()  # another rank, on its first read
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    (starting / gone.stdout.strip()).touch()  # a rank killed in its first read

    reader = WindowReader(small_store, cache=cfg)
    got = reader.read(ITEM, SPANS)
    assert reader.hold.holding and reader.behind.held  # its fills wait
    assert not (starting / gone.stdout.strip()).exists()  # the dead one's mark is gone
    assert not (starting / str(os.getpid())).exists()  # its own first read is served
    fills = zstore.cache_stats(cfg)["ram"]["fills"]
    reader.read(ITEM, SPANS)
    assert reader.behind.held and zstore.cache_stats(cfg)["ram"]["fills"] == fills

    assert reader.behind.pending  # its second read queued them, held

    (starting / str(live_process.pid)).unlink()  # the other rank's first batch is served
    again = reader.read(ITEM, SPANS)
    assert not reader.hold.holding
    assert reader.settle(timeout=120)
    assert zstore.cache_stats(cfg)["ram"]["fills"] > fills  # the shards are in now
    np.testing.assert_array_equal(again["wav"], got["wav"])


def test_a_process_that_forks_or_exits_starts_its_held_builds(small_store, tmp_path, live_process):
    """Held work holds the node's locks for its shards (the SSD writes of shards fetched
    whole): a process releases it before it forks (DataLoader workers must not inherit
    the locks; a torchrun job's workers, forked while a rank held its first fills, left
    shards unfetched) and when it exits (a process whose reads all ran while others
    were on their first reads)."""

    def config(name: str) -> zstore.CacheConfig:
        return zstore.CacheConfig(
            ram_dir=tmp_path / name,
            ram_bytes="64MB",
            ssd_dir=tmp_path / f"{name}-ssd",
            ssd_bytes="256MB",
            fetch="shard",
        )

    cfg = config("ram")
    starting = tmp_path / "ram" / "starting"
    starting.mkdir(parents=True)
    (starting / str(live_process.pid)).touch()  # another rank, on its first read

    script = (
        "import sys\n"
        "from zstore.format import Span\n"
        "from zstore.read import WindowReader\n"
        "import zstore\n"
        "cfg = zstore.CacheConfig(ram_dir=sys.argv[2], ram_bytes='64MB', ssd_dir=sys.argv[3],"
        " ssd_bytes='256MB', fetch='shard')\n"
        "reader = WindowReader(sys.argv[1], cache=cfg)\n"
        f"reader.read({ITEM!r}, {{'wav': Span(16000, 48000), 'act': Span(100, 300)}})\n"
        "assert reader.hold.holding and reader.writes.pending\n"
        "assert zstore.cache_stats(cfg)['ssd']['fills'] == 0\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, small_store, str(cfg.ram_dir), str(cfg.ssd_dir)],
        check=True,
        timeout=600,
    )
    filled = zstore.cache_stats(cfg)["ssd"]["fills"]
    assert filled == len(SPANS)  # the wav and act shards, written as it exited

    other = config("ram2")
    (tmp_path / "ram2" / "starting").mkdir(parents=True)
    (tmp_path / "ram2" / "starting" / str(live_process.pid)).touch()
    reader = WindowReader(small_store, cache=other)
    reader.read(ITEM, SPANS)
    assert reader.hold.holding and reader.writes.pending
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert not reader.hold.holding  # released before the fork
    assert reader.settle(timeout=120)
    assert zstore.cache_stats(other)["ssd"]["fills"] == filled


def test_builds_wait_for_other_first_reads_only_so_long(
    small_store, tmp_path, live_process, monkeypatch
):
    """A rank whose first read never ends (or a pid reused by another process) holds
    the others' fills back HOLD_AT_MOST seconds at most."""
    from zstore.read import _builds

    monkeypatch.setattr(_builds, "HOLD_AT_MOST", 0.0)
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ram_format="decoded", ssd_dir=None
    )
    starting = tmp_path / "ram" / "starting"
    starting.mkdir(parents=True)
    (starting / str(live_process.pid)).touch()
    reader = WindowReader(small_store, cache=cfg)
    reader.read(ITEM, SPANS)  # the first read asks for no fill
    assert not reader.hold.holding
    reader.read(ITEM, SPANS)
    assert reader.settle(timeout=120)
    assert zstore.cache_stats(cfg)["ram"]["fills"] > 0


def test_a_process_that_stops_reading_keeps_no_node_lock_others_wait_for(
    small_store, tmp_path, live_process, monkeypatch
):
    """A rank whose first batch is served and that then stops reading (it waits in an
    allreduce, or at the epoch's end, for ranks still on their first batch) starts its
    held work HOLD_AT_MOST seconds after its first read without another read, and so
    releases the node's locks that work holds.  Seen: 4 ranks, S3-like origin, encoded
    RAM form; a rank at the end of epoch 0 kept a held SSD write's fill lock, another
    rank's first read waited for that lock stripe, and the job hung."""
    from zstore.cache._locks import StripedLocks
    from zstore.read import _builds

    monkeypatch.setattr(_builds, "HOLD_AT_MOST", 1.0)
    released = threading.Event()
    real_release = _builds.FirstReadHold.release

    def release(self):
        real_release(self)
        released.set()

    monkeypatch.setattr(_builds.FirstReadHold, "release", release)
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram",
        ram_bytes="64MB",
        ssd_dir=tmp_path / "ssd",
        ssd_bytes="256MB",
        fetch="shard",
    )
    starting = tmp_path / "ram" / "starting"
    starting.mkdir(parents=True)
    (starting / str(live_process.pid)).touch()  # another rank, on its first read
    reader = WindowReader(small_store, cache=cfg, origin_fs=ModelledFileSystem()).open()
    reader.read(ITEM, SPANS)  # fetches its shards whole: their SSD writes are queued
    assert reader.hold.holding and not released.is_set()
    whole = reader.source.whole_fetch.whole
    fill_locks = reader.tiers.fill_locks
    other = StripedLocks(fill_locks.directory, fill_locks.kind, fill_locks.stripes)
    got: list[object] = []
    waiter = threading.Thread(
        target=lambda: got.append(
            other.acquire([whole.key(reader.layout(ITEM, "wav").object_key(0))])
        )
    )
    waiter.start()  # another process's read that needs this lock stripe
    waiter.join(120)
    stuck = waiter.is_alive()
    if stuck:
        reader.hold.release()  # let the test end
        waiter.join(120)
    assert not stuck, "the lock was held for good while this process read nothing"
    other.release(got[0])
    assert released.wait(120)  # its held SSD writes start without another read
    assert reader.settle(timeout=120)
    assert zstore.cache_stats(cfg)["ssd"]["fills"] > 0


def test_warm_builds_inline_and_a_fresh_process_reads_from_ram(small_store, tmp_path):
    """``zstore cache warm`` waits for its fills: when it returns, every shard is in."""
    from zstore.cli.warm import warm

    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="256MB", ram_format="decoded", ssd_dir=None
    )
    warm(small_store, cache=cfg, workers=2, progress=False)
    filled = zstore.cache_stats(cfg)["ram"]["fills"]
    assert filled > 0
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=cfg, seed=1)
    for i in range(len(ds)):
        ds[i]
    stats = zstore.cache_stats(cfg)
    assert stats["ram"]["fills"] == filled  # nothing left to fill
    assert stats["ram"]["hits"] > 0


@pytest.mark.parametrize("ram_format", ["decoded", "encoded"])
def test_warm_copies_nothing_out_and_the_tier_then_holds_the_source(
    small_h5, tmp_path, monkeypatch, ram_format
):
    """``zstore cache warm`` only fills: no item is assembled (its builds share one
    scratch buffer per thread), and afterwards every item, read whole from the RAM tier
    alone, equals what h5py reads from the HDF5 file.  Short chunks put the longer
    items across two shards, so one item's builds follow each other in that buffer."""
    import h5py

    import zstore.read._window_copy as copy_module

    store = tmp_path / "store.zarr"
    zstore.convert(
        small_h5, store, rates=RATES, chunk_seconds=0.1, workers=1, progress=False, pack_seconds=0
    )
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="256MB", ram_format=ram_format, ssd_dir=None
    )

    def assembled(*args, **kwargs):
        raise AssertionError("warm copied an item out")

    with monkeypatch.context() as m:
        m.setattr(copy_module, "assemble", assembled)
        done = zstore.warm(str(store), cache=cfg, workers=2, progress=False)
    filled = zstore.cache_stats(cfg)["ram"]["fills"]
    reader = WindowReader(str(store), cache=cfg)
    with h5py.File(small_h5, "r") as h5:
        assert done == {"items": len(h5), "bytes": sum(g[n].nbytes for g in h5.values() for n in g)}
        assert max(h5[item]["wav"].shape[-1] for item in h5) > 64 * 1600  # two shards
        for item in h5:
            got = reader.read(item, {"wav": None, "act": None})
            for name in ("wav", "act"):
                np.testing.assert_array_equal(got[name], h5[item][name][()])
    stats = zstore.cache_stats(cfg)["ram"]
    assert stats["fills"] == filled and stats["hits"] > 0  # all from the tier


def test_a_fill_holds_the_fork_gate_while_it_works(small_store, tmp_path, hold):
    """A process does not fork while its fill is inside SQLite or blosc: a child forked
    then would wait forever for a lock the fill's thread held (a DataLoader worker forked
    mid-fill hung opening its tier).  The fork waits for the shard's fill instead."""
    from zstore.read._builds import FORK_GATE
    from zstore.read._ram_shards import DecodedShards

    inside, release = hold(DecodedShards, "fill")  # inside the gate
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ram_format="decoded", ssd_dir=None
    )
    reader = WindowReader(small_store, cache=cfg).open()
    reader.start_builds()  # past its first read, which asks for no build
    reader.read(ITEM, SPANS)
    assert inside.wait(120)
    assert FORK_GATE.locked()  # a fork now would wait for this shard's fill
    release.set()
    assert reader.settle(timeout=120)


def test_the_fork_gate_is_shared_by_builds_and_closed_by_a_fork():
    """Builds in several threads are inside the gate at once; a fork waits until every
    one has left, and no build enters until the fork is done."""
    from zstore.read._builds import _ForkGate

    gate = _ForkGate()  # its fork handlers stay registered: leave it open and empty

    def build(inside: threading.Event, leave: threading.Event) -> threading.Thread:
        def run() -> None:
            with gate.held():
                inside.set()
                assert leave.wait(120)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    first_in, first_out = threading.Event(), threading.Event()
    first = build(first_in, first_out)
    assert first_in.wait(120)
    second_in, go = threading.Event(), threading.Event()
    go.set()
    build(second_in, go).join(120)
    assert second_in.is_set()  # beside the first (one lock made it wait)

    closed = threading.Event()
    fork = threading.Thread(target=lambda: (gate._close(), closed.set()))
    fork.start()
    try:
        assert not closed.wait(0.2)  # the fork waits for the build inside
        first_out.set()
        first.join(120)
        assert closed.wait(120)
        late = build(third_in := threading.Event(), go)
        assert not third_in.wait(0.2)  # no build enters while the fork runs
    finally:
        first_out.set()
        fork.join(120)
        gate._open()
    late.join(120)
    assert third_in.is_set() and not gate.locked()


def test_a_ram_fill_does_not_wait_for_an_ssd_write_beside_it(small_store, tmp_path, hold):
    """The RAM fills and the whole-shard SSD writes run in two threads of a process.  A
    fork waits for both, but neither waits for the other: as one lock, a fill waited for
    the SSD write beside it, that write for the SSD tier's index, and with 4 ranks the
    RAM tier's fill stalled for epochs."""
    from zstore.read._builds import FORK_GATE
    from zstore.read._ssd_shards import WholeShards

    writing, release = hold(WholeShards, "put")  # an SSD write, stopped inside the gate
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram",
        ram_bytes="64MB",
        ram_format="decoded",
        ssd_dir=tmp_path / "ssd",
        ssd_bytes="256MB",
        fetch="shard",
    )
    reader = WindowReader(small_store, cache=cfg, origin_fs=ModelledFileSystem()).open()
    reader.start_builds()  # past its first read, which asks for no RAM fill
    first = reader.read(ITEM, SPANS)
    assert writing.wait(120)
    assert FORK_GATE.locked()  # a fork now would wait for the write
    assert reader.behind.wait(60)  # the RAM fill ran meanwhile
    hits = zstore.cache_stats(cfg)["ram"]["hits"]
    again = reader.read(ITEM, SPANS)  # from the RAM tier
    assert zstore.cache_stats(cfg)["ram"]["hits"] > hits
    release.set()
    assert reader.settle(timeout=120)
    for name in SPANS:
        np.testing.assert_array_equal(again[name], first[name])


def test_a_first_read_with_a_ram_tier_only_takes_no_fill_lock(
    small_store, tmp_path, every_stripe_held
):
    """With a RAM tier and no SSD tier nothing keeps a window's encoded chunks, so
    fetching them takes no node lock: with 4 ranks, a batch's chunks waited for the
    other ranks' fetches of unrelated chunks on the same lock stripes."""
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ram_format="decoded", ssd_dir=None
    )
    reader = WindowReader(small_store, cache=cfg).open()
    # the shard indexes first: the RAM tier keeps those, under the lock
    reader.source.index([(reader.layout(ITEM, name), 0) for name in SPANS])
    every_stripe_held(reader.tiers.fill_locks)
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(reader.read(ITEM, SPANS)))
    t.start()
    t.join(120)
    assert not t.is_alive(), "the read waited for a node lock"
    root = zarr.open_group(small_store, mode="r")
    np.testing.assert_array_equal(got["wav"], root[f"{ITEM}/wav"][:, 16000:48000])
    assert reader.settle(timeout=120)


@pytest.mark.parametrize("ram_format", ["decoded", "encoded"])
def test_a_shard_read_around_a_held_lock_is_filled_on_its_next_read(
    small_store, tmp_path, ram_format, every_stripe_held
):
    """A first touch that finds the node's lock for its shard held (another process,
    or another fill on the same lock stripe) reads around it and fills nothing; the
    shard's next read, with the lock free, fills it behind the read, and the read after
    that is served from the tier."""
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ram_format=ram_format, ssd_dir=None
    )
    reader = WindowReader(small_store, cache=cfg).open()
    reader.start_builds()
    root = zarr.open_group(small_store, mode="r")
    want = root[f"{ITEM}/wav"][:, 16000:48000]
    release = every_stripe_held(reader.tiers.decode_locks)
    np.testing.assert_array_equal(reader.read(ITEM, SPANS)["wav"], want)
    assert reader.settle(timeout=120)
    fills = zstore.cache_stats(cfg)["ram"]["fills"]
    # no shard (a store on a local disk keeps its shard indexes out of the RAM tier)
    assert fills == (0 if reader.origin.local_disk else len(SPANS))
    release()
    np.testing.assert_array_equal(reader.read(ITEM, SPANS)["wav"], want)
    assert reader.settle(timeout=120)
    assert zstore.cache_stats(cfg)["ram"]["fills"] == fills + len(SPANS)  # both shards
    hits = zstore.cache_stats(cfg)["ram"]["hits"]
    np.testing.assert_array_equal(reader.read(ITEM, SPANS)["wav"], want)
    assert zstore.cache_stats(cfg)["ram"]["hits"] == hits + len(SPANS)


@pytest.mark.parametrize("ram_format", ["decoded", "encoded"])
def test_a_first_read_takes_as_many_origin_rounds_with_a_ram_tier_as_without(
    small_store, tmp_path, ram_format
):
    """The chunks of a read's shards to build, of those read around another process's
    fill and of those the tier does not admit are fetched in one round, as with no tier:
    fetched one kind after the other, a first read on an S3-like origin (20 ms a round)
    waited for two or three rounds."""
    import fcntl

    fs = ModelledFileSystem()
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ram_format=ram_format, ssd_dir=None
    )
    plain = WindowReader(small_store, cache=False, origin_fs=fs).open()
    reader = WindowReader(small_store, cache=cfg, origin_fs=fs).open()
    rounds: dict[str, int] = {"plain": 0, "tier": 0}
    reading = threading.current_thread()

    def counted(origin, name):
        real = origin.read_many

        def read_many(requests):
            if threading.current_thread() is reading:  # not the fill's, behind the read
                rounds[name] += 1
            return real(requests)

        origin.read_many = read_many

    counted(plain.origin, "plain")
    counted(reader.origin, "tier")
    locks = reader.tiers.decode_locks
    wav_key = reader.form.key(reader.layout(ITEM, "wav"), 0)
    act_key = reader.form.key(reader.layout(ITEM, "act"), 0)
    assert locks._stripes([wav_key]) != locks._stripes([act_key])
    assert locks._safe()
    held = locks._open(locks._stripes([act_key])[0])  # another process fills act's shard
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        got = reader.read(ITEM, SPANS)
    finally:
        os.close(held)
    want = plain.read(ITEM, SPANS)
    assert rounds["tier"] == rounds["plain"] == 2  # the shard indexes, then the chunks
    for name in SPANS:
        np.testing.assert_array_equal(got[name], want[name])
    assert reader.settle(timeout=120)
    assert zstore.cache_stats(cfg)["ram"]["fills"] >= 1  # wav's shard, behind the read


EXIT_SCRIPT = (
    """
import sys, threading
import zstore
from zstore.format import Span
from zstore.read import WindowReader
from zstore.read._ram_shards import ShardForm
from zstore.testing import ModelledFileSystem

real = ShardForm._finish_builds

def after_main_returns(self, *args, **kwargs):
    threading.main_thread().join()  # the fill runs while the interpreter exits
    return real(self, *args, **kwargs)

ShardForm._finish_builds = after_main_returns
cfg = zstore.CacheConfig(ram_dir=sys.argv[2], ram_bytes="64MB", ram_format="decoded", ssd_dir=None)
reader = WindowReader(sys.argv[1], cache=cfg, origin_fs=ModelledFileSystem()).open()
reader.start_builds()  # past its first read, which asks for no fill
reader.read("%s", {"wav": Span(16000, 48000), "act": Span(100, 300)})
"""
    % ITEM
)


def test_a_fill_queued_when_the_process_exits_is_finished(small_store, tmp_path):
    """A process that exits with a fill queued finishes it, also when the fill reads the
    origin concurrently (a URL): the interpreter then refuses new thread-pool work, so
    the fill reads its ranges in turn (it failed, with a warning, and the shard stayed
    out)."""
    import subprocess
    import sys

    ram = tmp_path / "ram"
    out = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, small_store, str(ram)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "failed" not in out.stderr, out.stderr
    cfg = zstore.CacheConfig(ram_dir=ram, ram_bytes="64MB", ram_format="decoded", ssd_dir=None)
    assert zstore.cache_stats(cfg)["ram"]["fills"] > len(SPANS)  # the shards are in


def test_the_first_batch_asks_for_no_fill(small_store, tmp_path, monkeypatch):
    """A process's first batch is read as with no tier: the tier is asked once which of
    its shards it holds (one index query, no lookup per shard), and no fill is asked for
    (no admission, no node lock, nothing handed over).  With its fills queued, the
    first batch of 50,000 packed utterances took 1.9x of no tier's time.  Its shards
    are filled when they are read again."""
    from zstore.cache import Tier

    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ram_format="decoded", ssd_dir=None
    )
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=cfg, seed=3)
    asked: list[str] = []

    def recorded(cls, name):
        real = getattr(cls, name)

        def call(*args, **kwargs):
            asked.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(cls, name, call)

    for cls, name in [
        (ShardForm, "_where"),
        (ShardForm, "_hand_off"),
        (ShardForm, "_built_meanwhile"),
        (Tier, "_lookup"),
        (Tier, "lacks"),
    ]:
        recorded(cls, name)
    loader = zstore.WindowLoader(ds, batch_size=4, prefetch=0, threads=1)
    batches = iter(loader)
    first = next(batches)  # prefetch=0: no later batch is read yet
    assert asked == ["lacks"]
    assert ds.settle(timeout=120)
    assert zstore.cache_stats(cfg)["ram"]["fills"] == 0  # nothing filled
    plain = zstore.WindowDataset(small_store, window_seconds=1.0, cache=False, seed=3)
    for b in range(4):
        np.testing.assert_array_equal(first["wav"][b].numpy(), plain[b]["wav"].numpy())

    again = next(iter(zstore.WindowLoader(ds, batch_size=4, prefetch=0, threads=1)))
    assert "_hand_off" in asked  # read again past the first batch: filled behind it
    assert ds.settle(timeout=120)
    assert zstore.cache_stats(cfg)["ram"]["fills"] > 0
    hits = zstore.cache_stats(cfg)["ram"]["hits"]
    third = next(iter(zstore.WindowLoader(ds, batch_size=4, prefetch=0, threads=1)))
    assert zstore.cache_stats(cfg)["ram"]["hits"] > hits  # now from the tier
    assert torch.equal(again["wav"], first["wav"]) and torch.equal(third["wav"], first["wav"])
    del batches


@pytest.mark.parametrize("start", ["release", "wait"])
def test_held_builds_start_on_release_or_wait(start):
    """``BehindBuilds(held=True)`` queues builds without running them; ``release`` starts
    them, and ``wait`` (a reader's ``settle``) does too rather than wait forever."""
    from zstore.read._builds import BehindBuilds

    ran: list[str] = []
    builds = BehindBuilds(held=True)
    assert builds.submit("a", lambda done: ran.append("a"))
    assert builds.submit(["b", "c"], lambda done: ran.append("bc"))
    assert ran == [] and "a" in builds and builds._thread is None
    if start == "release":
        builds.release()
    assert builds.wait(120)
    assert ran == ["a", "bc"] and not builds.pending
    assert builds.submit("d", lambda done: ran.append("d"))  # no longer held
    assert builds.wait(120) and ran[-1] == "d"
