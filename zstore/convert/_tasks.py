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
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from zstore.convert._source import SourceItem
from zstore.errors import ZstoreError

#: what a conversion whose worker process died says (the pool gives no reason)
WORKER_DIED = (
    "a conversion worker process ended abruptly. Either it was killed (the out-of-memory "
    "killer, a job scheduler's limit): give fewer workers (--workers N, workers=N); or it "
    "failed as it started: workers start by importing the script that called "
    "zstore.convert or zstore.append, so a script must make that call under "
    "'if __name__ == \"__main__\":' (Python's own message above, from each worker, says "
    "so). What was written is kept: once that is mended, the same call goes on from there"
)


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
    ctx = mp.get_context("spawn")  # HDF5 handles do not survive fork
    with cf.ProcessPoolExecutor(
        max_workers=workers, mp_context=ctx, initializer=die_with_parent, initargs=(os.getpid(),)
    ) as pool:
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
        for batch in tasks:
            results += fn(job, batch)
            bar.update(len(batch), sum(it.nbytes for it in batch))
        return results
    with contextlib.ExitStack() as stack:
        if pool is None:
            pool = stack.enter_context(local_pool(workers))
        assert pool is not None
        try:
            futures = {pool.submit(fn, job, batch): batch for batch in tasks}
            for fut in cf.as_completed(futures):
                results += fut.result()
                batch = futures[fut]
                bar.update(len(batch), sum(it.nbytes for it in batch))
        except cf.BrokenExecutor as e:
            raise ZstoreError(WORKER_DIED) from e
    return results


class Progress:
    """A progress bar of items with the source MB/s."""

    def __init__(self, total: int, desc: str, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="item", disable=not enabled)
        self.bytes = 0
        self.t0 = time.perf_counter()

    def update(self, n: int, nbytes: int) -> None:
        self.bytes += nbytes
        rate = self.bytes / max(1e-9, time.perf_counter() - self.t0) / 1e6
        self.bar.set_postfix_str(f"{rate:.0f} MB/s", refresh=False)
        self.bar.update(n)

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
