"""Ranks as spawned processes, for multi-process tests and benchmarks."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any


def spawn_ranks(
    target: Callable[..., None],
    n: int,
    args: Callable[[int, Any, Any], tuple[Any, ...]],
    timeout: float = 600,
) -> list[Any]:
    """Run ``target(*args(rank, barrier, queue))`` in ``n`` spawned processes, ``rank``
    in ``0..n-1``, with a barrier of all of them and a queue each puts its report on.
    Returns the reports in the order they came; raises RuntimeError naming the rank
    when one did not exit cleanly."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=target, args=args(rank, barrier, queue)) for rank in range(n)]
    for p in procs:
        p.start()
    reports = [queue.get(timeout=timeout) for _ in procs]
    for rank, p in enumerate(procs):
        p.join(timeout=timeout)
        if p.exitcode != 0:
            raise RuntimeError(f"rank {rank} of {n} exited with code {p.exitcode}")
    return reports
