"""Ranks as spawned processes, for multi-process tests and benchmarks."""

from __future__ import annotations

import multiprocessing as mp
import queue as queues
import time
from collections.abc import Callable
from typing import Any

#: How often the parent looks at the ranks' exit codes while it waits for reports.
POLL_SECONDS = 0.2


def spawn_ranks(
    target: Callable[..., None],
    n: int,
    args: Callable[[int, Any, Any], tuple[Any, ...]],
    timeout: float = 600,
) -> list[Any]:
    """Run ``target(*args(rank, barrier, queue))`` in ``n`` spawned processes, ``rank``
    in ``0..n-1``, with a barrier of all of them and a queue each puts its report on.

    Returns the reports in the order they came.  Raises RuntimeError naming the rank as
    soon as one exits with an error (its traceback is on stderr; the other ranks, which
    may wait at the barrier for it, are stopped), or when every rank has exited and some
    sent no report; TimeoutError when the reports are not all in after ``timeout``
    seconds.
    """
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=target, args=args(rank, barrier, queue)) for rank in range(n)]
    for p in procs:
        p.start()
    try:
        reports = _collect(procs, queue, timeout)
        for rank, p in enumerate(procs):
            p.join(timeout=timeout)
            if p.exitcode != 0:
                raise RuntimeError(f"rank {rank} of {n} exited with code {p.exitcode}")
        return reports
    finally:
        _stop(procs)


def _collect(procs: list[Any], queue: Any, timeout: float) -> list[Any]:
    """The ranks' reports, watching their exit codes between waits."""
    n = len(procs)
    reports: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(reports) < n:
        try:
            reports.append(queue.get(timeout=POLL_SECONDS))
            continue
        except queues.Empty:
            pass
        for rank, p in enumerate(procs):
            if p.exitcode not in (None, 0):
                raise RuntimeError(
                    f"rank {rank} of {n} exited with code {p.exitcode} before its report "
                    "(its traceback is above)"
                )
        if all(p.exitcode is not None for p in procs):
            try:  # a report sent just before its rank exited may still be in the pipe
                reports.append(queue.get(timeout=POLL_SECONDS * 5))
                continue
            except queues.Empty:
                raise RuntimeError(
                    f"all {n} ranks exited, {len(reports)} with a report: a rank returned "
                    "without putting one on the queue"
                ) from None
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(reports)} of {n} ranks reported within {timeout:g} s")
    return reports


def _stop(procs: list[Any]) -> None:
    """Terminate the ranks still running (after a failure) and reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()
