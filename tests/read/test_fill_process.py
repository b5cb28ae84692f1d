"""Fills behind the reads in a process of their own (``CacheConfig(fills="process")``,
:mod:`zstore.read._fill_process`): the windows are the source's, the helper builds the
shards the reads first touch into the node's RAM tier (the reading process builds
none), the origin is read once per chunk for the node, a killed helper leaves the reads
correct and its work to the reading process's thread, and the helper ends with its
reader.  On a corpus written by h5py as users write theirs: short utterances of true
float audio (not int16 values), each with a transcript and a speaker attribute."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import subprocess
import sys

import h5py
import numpy as np
import psutil
import pytest

import zstore
from zstore.errors import ConfigError
from zstore.read._fill_process import reading_processes, wanted
from zstore.read._ram_shards import ShardForm

RATE = 16000
WINDOW = 0.25


@pytest.fixture(scope="module")
def utterances(tmp_path_factory):
    """600 packed utterances of 0.2-1.0 s, float32 audio that is not int16 samples."""
    where = tmp_path_factory.mktemp("utterances")
    h5, store = where / "utt.h5", where / "utt.zarr"
    rng = np.random.default_rng(5)
    source = {}
    with h5py.File(h5, "w") as f:
        for i in range(600):
            g = f.create_group(f"spk{i % 7}/utt{i:04d}")
            wav = (rng.standard_normal((1, int(rng.integers(3200, 16000)))) * 0.1).astype(
                np.float32
            )
            g["wav"] = wav
            g["text"] = f"words of utterance {i} é"
            g.attrs["speaker"] = f"spk{i % 7}"
            source[f"spk{i % 7}/utt{i:04d}"] = wav
    zstore.convert(h5, store, rates={"wav": RATE}, progress=False)
    return store, source, h5


def _config(tmp_path, fills: str) -> zstore.CacheConfig:
    return zstore.CacheConfig(
        ram_dir=tmp_path / f"ram-{fills}", ram_bytes="256MB", ssd_dir=None, fills=fills
    )


def _check_batch(batch, source) -> int:
    """Each window equals its utterance's samples from the HDF5 file (zero padded)."""
    n = 0
    for i, name in enumerate(batch["item"]):
        start = round(float(batch["start"][i]) * RATE)
        got = np.asarray(batch["wav"][i])
        part = source[name][:, start : start + got.shape[1]]
        np.testing.assert_array_equal(got[:, : part.shape[1]], part, err_msg=name)
        assert not got[:, part.shape[1] :].any()  # an utterance shorter than the window
        n += 1
    return n


def _epoch_of_hits(loader, ds, cfg, source, epoch: int) -> None:
    """Epoch ``epoch`` reads the source's windows, every one from the RAM tier."""
    before = zstore.cache_stats(cfg)["ram"]["misses"]
    loader.set_epoch(epoch)
    assert sum(_check_batch(b, source) for b in loader) == len(ds)
    assert zstore.cache_stats(cfg)["ram"]["misses"] == before


def _dataset(store, cache) -> zstore.WindowDataset:
    return zstore.WindowDataset(
        store, window_seconds=WINDOW, cache=cache, seed=3, attrs=["text", "speaker"]
    )


def _started(ds: zstore.WindowDataset):
    """The dataset's fill process, started and answered (its first read starts it)."""
    ds[0]
    helper = ds.reader.fill_process
    assert helper is not None
    assert helper.started(120), "the fill process did not start"
    return helper


def test_the_fill_process_builds_the_shards_and_the_windows_are_the_sources(
    utterances, tmp_path, monkeypatch
):
    store, source, _ = utterances
    built_here: list[str] = []
    real = ShardForm._finish_builds

    def counted(self, todo, *args, **kwargs):
        built_here.extend(key for *_, key in todo)
        return real(self, todo, *args, **kwargs)

    monkeypatch.setattr(ShardForm, "_finish_builds", counted)
    cfg = _config(tmp_path, "process")
    ds = _dataset(store, cfg)
    helper = _started(ds)
    first = len(built_here)  # the first read's, queued in this thread before the helper answered
    built_here.clear()
    loader = zstore.WindowLoader(ds, batch_size=32, shuffle=True)
    texts = {}
    for epoch in range(2):
        loader.set_epoch(epoch)
        n = 0
        for batch in loader:
            n += _check_batch(batch, source)
            for name, text, speaker in zip(batch["item"], batch["text"], batch["speaker"]):
                texts[name] = text
                assert speaker == name.split("/")[0]
        assert n == len(ds)
        assert ds.reader.settle(120)
    assert texts["spk1/utt0001"] == "words of utterance 1 é"
    assert helper.built > 0, "the fill process built no shard"
    assert built_here == [], f"this process built {built_here} behind its reads"
    stats = zstore.cache_stats(cfg)
    # each shard was built once for the node: the first read's in this thread, before
    # the helper answered, and every other in the helper
    shards = sum(1 for d, _, files in os.walk(store) if d.endswith("wav/c/0") for _ in files)
    assert helper.built + first == shards
    assert stats["ram"]["fills"] >= shards  # and the batch records of the attributes
    # a third epoch is served from the tier the helper filled
    _epoch_of_hits(loader, ds, cfg, source, 2)


def test_the_node_lock_of_a_shard_is_held_until_the_fill_process_has_built_it(utterances, tmp_path):
    """The reading process hands its lock over (a descriptor of the same open file):
    it is never free between the reader's fetch of the window's chunks and the build,
    so no other process on the node fetches the shard meanwhile."""
    store, source, _ = utterances
    ds = _dataset(store, _config(tmp_path, "process"))
    helper = _started(ds)
    assert ds.reader.settle(120)
    os.kill(helper.pid, signal.SIGSTOP)
    try:
        for i in reversed(range(len(ds))):  # until a read hands a shard over
            window = ds[i]
            part = source[window["item"]][:, : window["wav"].shape[1]]
            assert window["wav"].shape[0] == part.shape[0]
            if helper.pending:
                break
        keys = list(helper.pending)
        assert keys, "no read handed a shard to the fill process"
        locks = ds.reader.tiers.decode_locks
        for key in keys:
            assert locks.acquire([key], wait=False) is None, key
    finally:
        os.kill(helper.pid, signal.SIGCONT)
    assert ds.reader.settle(120)
    for key in keys:
        held = locks.acquire([key], wait=False)
        assert held is not None, key
        locks.release(held)


def test_windows_through_the_fill_process_equal_those_through_the_thread(utterances, tmp_path):
    store, _, _ = utterances
    seen = {}
    for fills in ("process", "thread"):
        ds = _dataset(store, _config(tmp_path, fills))
        if fills == "process":
            _started(ds)
        else:
            assert ds.reader.open().fill_process is None
        loader = zstore.WindowLoader(ds, batch_size=50, shuffle=True)
        loader.set_epoch(4)
        seen[fills] = [(list(b["item"]), np.asarray(b["wav"]).copy()) for b in loader]
    for (items_p, wav_p), (items_t, wav_t) in zip(seen["process"], seen["thread"], strict=True):
        assert items_p == items_t
        np.testing.assert_array_equal(wav_p, wav_t)


def test_a_killed_fill_process_leaves_the_reads_right_and_the_fills_to_the_thread(
    utterances, tmp_path, caplog
):
    store, source, _ = utterances
    cfg = _config(tmp_path, "process")
    ds = _dataset(store, cfg)
    helper = _started(ds)
    loader = zstore.WindowLoader(ds, batch_size=16, shuffle=True)
    batches = iter(loader)
    n = _check_batch(next(batches), source)
    os.kill(helper.pid, signal.SIGKILL)
    with caplog.at_level(logging.WARNING, logger="zstore"):
        n += sum(_check_batch(b, source) for b in batches)
        assert n == len(ds)
        assert ds.reader.settle(120)
    assert any(
        "fill process" in r.getMessage() and "exit code -9" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    assert not helper.ready()
    # its locks went with it: the next epoch fills every shard left out, here
    loader.set_epoch(1)
    assert sum(_check_batch(b, source) for b in loader) == len(ds)
    assert ds.reader.settle(120)
    _epoch_of_hits(loader, ds, cfg, source, 2)


def test_the_fill_process_ends_with_its_reader(utterances, tmp_path):
    store, _, _ = utterances
    ds = _dataset(store, _config(tmp_path, "process"))
    helper = _started(ds)
    proc = helper._proc
    assert proc is not None and proc.poll() is None
    del ds, helper
    gc.collect()
    assert proc.wait(120) == 0


def test_where_fills_run(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="fills must be 'auto', 'process' or 'thread'"):
        zstore.CacheConfig(fills="elsewhere").resolved()
    monkeypatch.setenv("ZSTORE_FILLS", "thread")
    assert zstore.CacheConfig().resolved().fills == "thread"
    assert zstore.CacheConfig(fills="process").resolved().fills == "process"
    assert wanted("process") and not wanted("thread")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert reading_processes() == 4 and wanted("auto")
    assert not wanted("auto", packed=False)  # long recordings: WindowLoader's threads decode
    assert not wanted("auto", others=7)  # 8 processes use the node's tiers
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert not wanted("auto")  # every core reads: the fills stay in each process


def _ranges(counter) -> tuple[dict[str, list[tuple[int, int]]], dict[str, int]]:
    """The byte ranges of chunk objects GET at the S3 server, by path, and how many
    times each path's end (its shard index) was read."""
    fetched: dict[str, list[tuple[int, int]]] = {}
    ends: dict[str, int] = {}
    with counter.lock:
        for path, header in counter.ranges:
            if "/c/" in path:
                first, last = header.removeprefix("bytes=").split("-")
                if first:
                    fetched.setdefault(path, []).append((int(first), int(last)))
                else:
                    ends[path] = ends.get(path, 0) + 1
    return fetched, ends


def test_on_s3_the_fill_process_fetches_only_what_the_read_did_not(s3, utterances, tmp_path):
    """From moto's S3 through s3fs: the read of a shard's window fetches its chunks and
    hands their bytes to the helper, which fetches the shard's other chunks: no byte of
    the shard, nor its index, is fetched twice for the node.  Then a whole epoch
    through WindowLoader reads the source's windows."""
    options, counter = s3
    _, source, h5 = utterances
    url = "s3://zstore-test/fills/utt.zarr"
    zstore.convert(h5, url, rates={"wav": RATE}, storage_options=options, progress=False)
    cfg = _config(tmp_path, "process")
    ds = zstore.WindowDataset(
        url, window_seconds=WINDOW, cache=cfg, seed=3, storage_options=options
    )
    helper = _started(ds)
    assert ds.reader.settle(120)
    with counter.lock:
        counter.ranges.clear()
    for i in reversed(range(0, len(ds), 37)):  # one read at a time, each built before the next
        window = ds[i]
        _check_batch({k: [window[k]] for k in ("item", "start", "wav")}, source)
        assert ds.reader.settle(120)
    assert helper.built > 1
    fetched, ends = _ranges(counter)
    assert fetched
    assert all(n == 1 for n in ends.values()), ends
    for path, spans in fetched.items():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start > end, f"{path}: bytes fetched twice ({spans})"
    loader = zstore.WindowLoader(ds, batch_size=32, shuffle=True)
    assert sum(_check_batch(b, source) for b in loader) == len(ds)


def test_auto_fills_in_a_process_for_packed_items_only(utterances, small_store, tmp_path):
    """``fills="auto"``: a store of packed items gets a fill process where a core is
    left for it (one process reads here); a store of long recordings fills in a thread."""
    store, _, _ = utterances
    packed = _dataset(store, _config(tmp_path, "auto")).reader.open()
    spare = os.cpu_count() is not None and len(os.sched_getaffinity(0)) > 1
    assert (packed.fill_process is not None) == spare
    long = zstore.WindowDataset(
        small_store,
        window_seconds=1.0,
        cache=zstore.CacheConfig(
            ram_dir=tmp_path / "ram-long", ram_bytes="64MB", ram_format="decoded", ssd_dir=None
        ),
    ).reader.open()
    assert long.fill_process is None


def test_a_fill_process_that_cannot_start_leaves_the_fills_to_the_thread(
    utterances, tmp_path, monkeypatch, caplog
):
    store, source, _ = utterances
    monkeypatch.setattr(sys, "executable", "/bin/false")  # an interpreter that fails at once
    cfg = _config(tmp_path, "process")
    ds = _dataset(store, cfg)
    ds[0]
    with caplog.at_level(logging.WARNING, logger="zstore"):
        assert not ds.reader.fill_process.started(120)
    assert any(
        "fill process" in r.getMessage() and "exit code 1" in r.getMessage() for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    loader = zstore.WindowLoader(ds, batch_size=32, shuffle=True)
    assert sum(_check_batch(b, source) for b in loader) == len(ds)
    assert ds.reader.settle(120)
    _epoch_of_hits(loader, ds, cfg, source, 1)


_KILLED_PARENT = """
import os, sys, warnings
warnings.simplefilter("ignore")
import zstore
cfg = zstore.CacheConfig(ram_dir=sys.argv[2], ram_bytes="256MB", ssd_dir=None, fills="process")
ds = zstore.WindowDataset(sys.argv[1], window_seconds=0.25, cache=cfg, seed=3)
ds[0]
helper = ds.reader.fill_process
assert helper.started(120)
r, w = os.pipe()
child = os.fork()
if child == 0:  # a DataLoader worker's stand-in: it lives until the test closes stdin
    os.close(w)
    sys.stdin.read()
    os._exit(0)
print(helper.pid, child, flush=True)
sys.stdin.read()  # killed here
"""


def test_a_killed_reader_with_forked_children_does_not_leave_its_fill_process(utterances, tmp_path):
    """A reading process killed (no finalizer runs) while children it forked live: they
    closed their copies of its socket at the fork, so the helper sees its end and exits."""
    store, _, _ = utterances
    parent = subprocess.Popen(
        [sys.executable, "-c", _KILLED_PARENT, str(store), str(tmp_path / "ram")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        helper_pid, child_pid = map(int, parent.stdout.readline().split())
        helper, child = psutil.Process(helper_pid), psutil.Process(child_pid)
        parent.kill()
        parent.wait(120)
        helper.wait(120)  # psutil.TimeoutExpired if it waits for a reader that is gone
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
    finally:
        parent.kill()
        parent.stdin.close()
        with contextlib.suppress(psutil.Error):
            psutil.Process(child_pid).wait(120)
