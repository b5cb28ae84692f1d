"""Helpers for the benchmark tools: a tool's section of docs/benchmarks.md, a process's
private memory, and ranks run as spawned processes."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any


def run_ranks(
    target: Callable[..., None],
    args: Callable[..., tuple[Any, ...]],
    ranks: int,
    timeout: float = 3600,
) -> list[Any]:
    """Run ``target(*args(r, barrier, queue))`` in ``ranks`` spawned processes, ``r`` in
    ``0..ranks-1``, with a barrier of all of them and a queue each puts its report on;
    the reports, in the order they came."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=target, args=args(r, barrier, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    reports = [queue.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(600)
    return reports


def replace_section(docs: str, begin: str, end: str, section: str) -> None:
    """Replace the text between the ``begin`` and ``end`` markers in
    ``docs/benchmarks.md`` with ``section`` (which carries both markers), or append it."""
    path = os.path.join(docs, "benchmarks.md")
    text = open(path).read() if os.path.exists(path) else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    with open(path, "w") as f:
        f.write(text)


def own_bytes() -> int:
    """This process's anonymous memory (heap, arrays: what it allocated itself), in bytes;
    unlike :func:`private_bytes` it leaves out file pages it maps (page cache)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    return 0


def private_bytes() -> int:
    """This process's private memory (Private_Clean + Private_Dirty), in bytes."""
    out = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                out += int(line.split()[1]) * 1024
    return out
