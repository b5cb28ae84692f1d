"""Conversion tasks on an existing Dask distributed cluster (``--dask ADDRESS``).

Each batch of items is one task; a task writes only its own items' arrays, so every shard has
one writer (two writers of parts of one shard lose data: zarr-python #3682).  h5py
serialises calls within a process, so workers should run one thread each
(``dask worker --nthreads 1 --nworkers N``); a warning says so otherwise.  Sources and
destination must be reachable from the workers under the same path or URL.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from zstore.errors import ZstoreError


@contextmanager
def connected(dask: Any) -> Iterator[Any]:
    """A ``distributed.Client`` for ``dask``: a client (used as is) or a scheduler
    address (connected here and closed on exit)."""
    try:
        import distributed
    except ImportError:
        raise ZstoreError(
            "--dask needs the distributed package: pip install "
            "'zstore[dask]' (or distributed) in this environment and on "
            "the workers"
        ) from None
    if isinstance(dask, distributed.Client):
        yield dask
        return
    if not isinstance(dask, str) or not dask:
        raise ZstoreError(
            f"--dask {dask!r}: give a scheduler address such as "
            "tcp://10.0.0.5:8786, or a distributed.Client"
        )
    try:
        client = distributed.Client(dask)  # distributed.comm.timeouts.connect
    except (OSError, TimeoutError) as e:
        raise ZstoreError(
            f"--dask {dask}: cannot reach the scheduler ({e}); start one with "
            "'dask scheduler' and workers with 'dask worker ADDRESS "
            "--nthreads 1', or check the address"
        ) from None
    try:
        yield client
    finally:
        client.close()


def check_workers(client: Any) -> int:
    """The number of workers; warn when they run several threads (h5py serialises)."""
    threads = client.nthreads()
    if not threads:
        raise ZstoreError(
            f"the Dask cluster at {client.scheduler.address} has no workers; "
            "start some with 'dask worker ADDRESS --nthreads 1'"
        )
    many = sorted(a for a, n in threads.items() if n > 1)
    if many:
        warnings.warn(
            f"{len(many)} Dask worker(s) run several threads (e.g. {many[0]}: "
            f"{threads[many[0]]}); h5py reads one call at a time per process, "
            "so start workers with --nthreads 1 --nworkers N for parallel "
            "conversion",
            stacklevel=3,
        )
    return len(threads)


def run_tasks(
    client: Any, fn: Callable[..., Any], job: Any, batches: Sequence[list[Any]], bar: Any
) -> list[Any]:
    """``fn(job, batch)`` for every batch of items as a task; the elements of its
    results, in completion order.  The first failure cancels the rest and is raised
    here, as the local pool does."""
    import distributed

    futures = {client.submit(fn, job, batch, pure=False): batch for batch in batches}
    results: list[Any] = []
    try:
        for fut in distributed.as_completed(list(futures)):
            results += fut.result()
            batch = futures[fut]
            bar.update(len(batch), sum(it.nbytes for it in batch))
    except BaseException:
        client.cancel(list(futures))
        raise
    return results
