"""Helpers for the benchmark tools: a tool's section of docs/benchmarks.md, a process's
private memory, and the order of interleaved repetitions."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


def in_turn(items: Sequence[T], reps: int) -> Iterator[T]:
    """``items`` ``reps`` times over, each one first in turn: the order of an interleaved
    benchmark, where no configuration always runs first after the one before."""
    for rep in range(reps):
        turn = rep % len(items)
        yield from items[turn:]
        yield from items[:turn]


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
