"""Reused read memory (zstore.buffers): ranges land in kept slabs, a slab is reused only
once nothing refers to it, and windows read through it equal the source."""

from __future__ import annotations

import gc
import threading

import numpy as np
import zarr

import zstore
from zstore.buffers import IDLE_READS, Slabs
from zstore.format.layout import Span
from zstore.origin import Origin
from zstore.read.reader import WindowReader


def test_a_slab_is_reused_only_once_no_view_of_it_is_left():
    slabs = Slabs(slab_bytes=1000, keep_bytes=2000)
    a = slabs.take(600)
    a[:] = b"a" * 600
    b = slabs.take(600)  # does not fit beside a: the second slab
    b[:] = b"b" * 600
    assert slabs.in_use() == 2
    c = slabs.take(600)  # both slabs in use and none more kept: memory of its own
    c[:] = b"c" * 600
    assert bytes(a) == b"a" * 600 and bytes(b) == b"b" * 600
    held = np.frombuffer(a, dtype=np.uint8)  # an array over a view keeps its slab
    del a
    d = slabs.take(600)
    d[:] = b"d" * 600
    assert bytes(held) == b"a" * 600
    del held, b, c, d
    gc.collect()
    assert slabs.in_use() == 0
    e = slabs.take(1000)
    assert slabs.in_use() == 1 and len(e) == 1000


def test_ranges_larger_than_a_slab_get_memory_of_their_own():
    slabs = Slabs(slab_bytes=1000, keep_bytes=4000)
    assert slabs.take(1001) is None and slabs.take(0) is None
    assert slabs.in_use() == 0


def test_release_idle_drops_the_slabs_after_calls_in_a_row_with_no_reads():
    slabs = Slabs(slab_bytes=1000, keep_bytes=4000)
    view = slabs.take(10)
    slabs.release_idle()  # a read since the last call: kept
    assert slabs.in_use() == 1
    del view
    for _ in range(IDLE_READS - 1):  # windows now and then all from the RAM tier: kept
        slabs.release_idle()
    assert len(slabs._slabs) == 1
    slabs.take(10)
    for _ in range(IDLE_READS - 1):  # a read in between starts the count again
        slabs.release_idle()
    assert len(slabs._slabs) == 1
    slabs.release_idle()
    slabs.release_idle()  # IDLE_READS in a row with no read: dropped
    assert slabs._slabs == []
    assert slabs.take(10) is not None


def test_origin_reads_ranges_into_reused_memory_without_overwriting_what_is_held(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 * 2**20, dtype=np.uint8).tobytes()
    (tmp_path / "obj").write_bytes(data)
    origin = Origin(str(tmp_path))
    step = 300_000
    kept = origin.read_many([("obj", 0, step), ("obj", step, 2 * step)])
    assert [bytes(k) for k in kept] == [data[:step], data[step : 2 * step]]
    starts = range(0, len(data) - step, step)
    for _ in range(60):  # ~180 MB of reads: the slabs turn over many times
        for start in starts:
            (got,) = origin.read_many([("obj", start, start + step)])
            assert got == data[start : start + step]
    assert [bytes(k) for k in kept] == [data[:step], data[step : 2 * step]]
    assert origin.read_many([("obj", -10, None)]) == [data[-10:]]  # a suffix: bytes
    reads = 60 * len(starts)
    assert origin.requests == 2 + reads + 1 and origin.bytes == (2 + reads) * step + 10


def test_windows_read_through_reused_memory_equal_the_source(small_store, monkeypatch):
    monkeypatch.setattr("zstore.buffers.KEEP_BYTES", 2 << 20)  # two slabs, reused often
    monkeypatch.setattr("zstore.buffers.SLAB_BYTES", 1 << 20)
    root = zarr.open_group(small_store, mode="r")
    items = list(root.group_keys())
    reader = WindowReader(small_store, cache=False).open()
    rng = np.random.default_rng(3)
    windows, outs, expect = [], [], []
    for _ in range(40):
        item = items[int(rng.integers(len(items)))]
        length = root[f"{item}/act"].shape[-1]
        a = int(rng.integers(0, max(1, length - 300)))
        b = min(length, a + 300)
        spans = {"act": Span(a, b), "wav": Span(a * 160, b * 160)}
        windows.append((item, spans, None))
        outs.append(
            {
                "act": np.empty((root[f"{item}/act"].shape[0], b - a), np.float32),
                "wav": np.empty((root[f"{item}/wav"].shape[0], (b - a) * 160), np.float32),
            }
        )
        expect.append((root[f"{item}/act"][:, a:b], root[f"{item}/wav"][:, a * 160 : b * 160]))
    for lo in range(0, 40, 20):  # batches of 20 windows: ~4 MB of ranges each
        reader.read_batch(windows[lo : lo + 20], outs[lo : lo + 20])
    for out, (act, wav) in zip(outs, expect):
        np.testing.assert_array_equal(out["act"], act)
        np.testing.assert_array_equal(out["wav"], wav)
    assert reader.origin._slabs.slab_bytes == 1 << 20 and reader.origin._slabs._slabs


def test_ssd_tier_hits_by_ranges_land_in_reused_memory(small_store, monkeypatch, tmp_path):
    """With ``fetch="range"`` each chunk is an SSD value; its hits are read into the
    reader's slabs as the origin's ranges are (each into new bytes, they page-faulted
    ~85,000 fresh pages an epoch), and windows read through them equal the source."""
    monkeypatch.setattr("zstore.buffers.KEEP_BYTES", 2 << 20)  # two slabs, reused often
    monkeypatch.setattr("zstore.buffers.SLAB_BYTES", 1 << 20)
    cfg = zstore.CacheConfig(
        ram_dir=None, ram_bytes=0, ssd_dir=tmp_path / "ssd", ssd_bytes="256MB", fetch="range"
    )
    root = zarr.open_group(small_store, mode="r")
    items = sorted(root.group_keys())
    reader = WindowReader(small_store, cache=cfg).open()
    spans = {item: {"act": Span(0, 200), "wav": Span(0, 32000)} for item in items}
    for item in items:  # the first pass fills the SSD tier from the origin
        reader.read(item, spans[item])
    assert reader.settle(timeout=120)
    slabs, taken = reader.origin._slabs, []
    take = slabs.take
    monkeypatch.setattr(slabs, "take", lambda n: taken.append(n) or take(n))
    requests = reader.origin.requests
    got = [reader.read(item, spans[item]) for item in items for _ in range(3)]
    assert reader.origin.requests == requests  # every chunk was an SSD hit
    assert len(taken) >= 3 * len(items)  # read into the slabs
    for i, item in enumerate(items):
        for out in got[3 * i : 3 * i + 3]:
            np.testing.assert_array_equal(out["act"], root[f"{item}/act"][:, :200])
            np.testing.assert_array_equal(out["wav"], root[f"{item}/wav"][:, :32000])


def test_a_thread_never_sees_an_origin_half_opened(small_store, monkeypatch):
    """A process's first use of an origin from two threads at once (WindowLoader's batch
    thread and a fill thread): the second one, arriving while the first is still
    opening it, gets a whole origin (it raised AttributeError: '_local_disk', failing the
    batch).  The second thread runs inside the first one's open, so the order is fixed."""
    import zstore.origin as origin_module

    real = origin_module.local_fs_kind
    origin = Origin(small_store)
    seen: list[object] = []

    def other_thread() -> None:
        try:
            seen.append((origin.local_disk, origin.remote))
        except Exception as e:  # the half-opened origin's
            seen.append(e)

    started: list[threading.Thread] = []

    def opening(path: str) -> tuple[bool, bool]:
        if not started:  # the first thread, halfway through its open
            t = threading.Thread(target=other_thread)
            started.append(t)
            t.start()
            t.join(timeout=120)
        return real(path)

    monkeypatch.setattr(origin_module, "local_fs_kind", opening)
    assert origin.local_disk == real(small_store)[1]
    assert seen == [(real(small_store)[1], real(small_store)[0])]
    assert origin.read("zarr.json") == open(f"{small_store}/zarr.json", "rb").read()
