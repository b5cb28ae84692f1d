"""Running conversion tasks: items cut into batches, run in a local pool of worker
processes (that die with the converter) or on a Dask cluster, with a progress bar."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import math
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from zstore.convert._source import SourceItem
from zstore.errors import ZstoreError
from zstore.units import format_size

#: what a conversion whose worker process died says (the pool gives no reason)
WORKER_DIED = (
    "a conversion worker process ended abruptly. Either it was killed (the out-of-memory "
    "killer, a job scheduler's limit): give fewer workers (--workers N, workers=N); or it "
    "failed as it started: workers start by importing the script that called "
    "zstore.convert or zstore.append, so a script must make that call under "
    "'if __name__ == \"__main__\":' (Python's own message above, from each worker, says "
    "so). What was written is kept: once that is mended, the same call goes on from there"
)


#: In a worker (or the converting process itself, with one worker): where the source
#: bytes of items written in blocks (long recordings, :mod:`zstore.convert._blocks`) go
#: as each block is written, so the progress bar moves within an item that takes
#: minutes.  None where nothing listens (a Dask worker).
_in_flight: Callable[[int], None] | None = None
#: how often the converting process looks at its workers' bytes in flight (s)
POLL_SECONDS = 0.5


def in_flight(nbytes: int) -> None:
    """Say that ``nbytes`` more source bytes of an unfinished item were written (its
    writer takes them back, negative, once the item is done and counted whole)."""
    if _in_flight is not None:
        _in_flight(nbytes)


class Pool(cf.ProcessPoolExecutor):
    """The local worker processes, with the count of source bytes their unfinished
    items have written (:func:`in_flight`)."""

    def __init__(self, workers: int) -> None:
        ctx = mp.get_context("spawn")  # HDF5 handles do not survive fork
        self.written = ctx.Value("q", 0)
        super().__init__(
            max_workers=workers,
            mp_context=ctx,
            initializer=_start_worker,
            initargs=(os.getpid(), self.written),
        )

    def _spawn_process(self) -> None:
        """Start a worker with SIGINT blocked (the mask survives the exec): a Ctrl-C that
        reaches it while it starts (its imports take about a second) waits for its
        initializer, which ends it quietly, where it printed the KeyboardInterrupt
        traceback of its imports under the converter's one line."""
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            super()._spawn_process()  # type: ignore[misc]  # CPython 3.9+, not in typeshed
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _start_worker(parent: int, written: Any) -> None:
    """Worker initializer: :func:`die_with_parent`, and count bytes in flight into the
    pool's shared ``written``."""
    global _in_flight
    die_with_parent(parent)
    signal.signal(signal.SIGINT, _interrupted)
    try:  # a Ctrl-C that came while this worker started (see Pool) is delivered now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.getsignal(signal.SIGINT)  # (a call: the handler runs by this one's end)
    except SystemExit:
        os._exit(130)  # ends as an idle worker does: raised here, the pool logs it

    def add(nbytes: int) -> None:
        with written.get_lock():
            written.value += nbytes

    _in_flight = add


def _interrupted(signum: int, frame: Any) -> None:
    """Ctrl-C reaches the whole process group: a worker ends quietly (the converter
    says "interrupted"), where an idle one printed Python's traceback of its wait."""
    raise SystemExit(130)


def task_result(fut: cf.Future[Any]) -> Any:
    """A pool task's result.  A worker that Ctrl-C reached inside a task ends it with
    :func:`_interrupted`'s SystemExit(130), which the pool hands back as the task's
    exception: taken here before this process's own KeyboardInterrupt, it ended the
    converter with status 130 and not a word, and would end a caller's Python (a
    script, a notebook's kernel) as quietly.  It is a KeyboardInterrupt here."""
    try:
        return fut.result()
    except SystemExit as e:
        if e.code == 130:
            raise KeyboardInterrupt from None
        raise


def die_with_parent(parent: int) -> None:
    """Worker initializer: end this worker when the converting process dies, even by
    SIGKILL, so no orphan keeps writing into the destination beside a rerun."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: watch the parent from a thread

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


#: A task is a batch of items: at most this many, and this many source bytes, so
#: small items do not pay a process round trip and a file open each.
BATCH_ITEMS, BATCH_BYTES = 256, 64 * 2**20


def batches(items: list[SourceItem], workers: int) -> list[list[SourceItem]]:
    """Items in source order, cut into tasks: several per worker, so they balance."""
    most = max(1, min(BATCH_ITEMS, math.ceil(len(items) / (4 * max(1, workers)))))
    out: list[list[SourceItem]] = []
    nbytes = 0
    for it in items:
        if not out or len(out[-1]) >= most or nbytes + it.nbytes > BATCH_BYTES:
            out.append([])
            nbytes = 0
        out[-1].append(it)
        nbytes += it.nbytes
    return out


@contextmanager
def local_pool(workers: int) -> Iterator[cf.ProcessPoolExecutor | None]:
    """``workers`` worker processes (None for one), started now: their imports (numpy,
    h5py, zarr: about a second) overlap the scan of the source."""
    if workers <= 1:
        yield None
        return
    with Pool(workers) as pool:
        for _ in range(workers):
            pool.submit(int)  # a process starts per task while none is idle
        yield pool


def run_batches(
    fn: Any,
    job: Any,
    items: list[SourceItem],
    workers: int,
    bar: Any,
    client: Any = None,
    pool: cf.ProcessPoolExecutor | None = None,
    tasks: list[Any] | None = None,
) -> list[Any]:
    """``fn(job, batch)`` over batches of ``items`` (or over ``tasks``, batches cut
    already: sequences of items); its lists' elements, concatenated.  Runs on
    ``client``'s cluster, in ``pool``, or in ``workers`` local processes."""
    if client is not None:
        from zstore.convert._cluster import check_workers, run_tasks

        cut = tasks if tasks is not None else batches(items, check_workers(client))
        return run_tasks(client, fn, job, cut, bar)
    if tasks is None:
        tasks = batches(items, workers)
    results: list[Any] = []
    if workers <= 1 and pool is None:
        global _in_flight
        _in_flight = bar.add_in_flight
        try:
            for batch in tasks:
                results += fn(job, batch)
                bar.update(len(batch), sum(it.nbytes for it in batch))
        finally:
            _in_flight = None
        return results
    with contextlib.ExitStack() as stack:
        if pool is None:
            pool = stack.enter_context(local_pool(workers))
        assert pool is not None
        written = getattr(pool, "written", None)
        try:
            futures = {pool.submit(fn, job, batch): batch for batch in tasks}
            pending = set(futures)
            while pending:
                done, pending = cf.wait(pending, POLL_SECONDS, cf.FIRST_COMPLETED)
                if written is not None:  # a finished item's blocks are taken back by now
                    bar.set_in_flight(written.value, refresh=not done)
                for fut in done:
                    results += task_result(fut)
                    batch = futures[fut]
                    bar.update(len(batch), sum(it.nbytes for it in batch))
        except cf.BrokenExecutor as e:
            raise ZstoreError(WORKER_DIED) from e
    return results


class Progress:
    """A progress bar of items with the source MB/s, which counts the bytes written of
    items still being written (long recordings, written in blocks) too."""

    def __init__(self, total: int, desc: str, enabled: bool):
        from tqdm import tqdm

        # no bar for no items (a corpus all packed has no unpacked ones to count)
        self.bar = tqdm(total=total, desc=desc, unit="item", disable=not enabled or total == 0)
        self.bytes = 0  # of finished items
        self.in_flight = 0  # written of unfinished ones
        self.t0 = time.perf_counter()

    def _postfix(self, refresh: bool) -> None:
        done = self.bytes + self.in_flight
        rate = done / max(1e-9, time.perf_counter() - self.t0) / 1e6
        self.bar.set_postfix_str(f"{format_size(done)}, {rate:.0f} MB/s", refresh=refresh)

    def update(self, n: int, nbytes: int) -> None:
        self.bytes += nbytes
        self._postfix(refresh=False)
        self.bar.update(n)

    def add_in_flight(self, nbytes: int) -> None:
        """Bytes written of an unfinished item (this process writes it)."""
        self.set_in_flight(self.in_flight + nbytes)

    def set_in_flight(self, nbytes: int, refresh: bool = True) -> None:
        """Bytes written of the unfinished items (the workers' count); ``refresh``: show
        it now (else with the next update)."""
        if nbytes != self.in_flight:
            self.in_flight = nbytes
            self._postfix(refresh)

    def close(self) -> None:
        self.bar.close()


@contextmanager
def cluster_client(dask: Any) -> Iterator[Any]:
    """The Dask client to run tasks on, or None for the local process pool."""
    if dask is None:
        yield None
        return
    from zstore.convert._cluster import connected

    with connected(dask) as client:
        yield client
