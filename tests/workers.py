"""Functions run in spawned processes by the multi-process tests (importable by name)."""

from __future__ import annotations

import os
import signal
import sys

import numpy as np


def fill_same_key(tier_dir: str, budget: int, barrier, rounds: int, queue) -> None:
    """Write and read one key many times; report any value that is not exactly right."""
    from zstore.cache._stats import Stats
    from zstore.cache.tier import Tier

    tier = Tier("ram", tier_dir, budget, Stats(None))
    value = bytes(np.arange(200_000, dtype=np.uint8) * 7 % 251)
    barrier.wait()
    bad = 0
    for _ in range(rounds):
        tier.put("shared", value)
        got = tier.get("shared")
        if got is not None and got != value:
            bad += 1
    queue.put(bad)


def write_then_hang(tier_dir: str, ready_file: str) -> None:
    """Start a put, write half the value file, tell the parent, then wait to be killed."""
    from zstore.cache import _tier_files, tier
    from zstore.cache._stats import Stats

    original = _tier_files.TierDisk._write

    def half_write(self, full_path, iterator, mode, encoding=None):
        data = b"".join(iterator)
        os.makedirs(os.path.dirname(full_path), exist_ok=True)
        with open(full_path, mode) as f:
            f.write(data[: len(data) // 2])
            f.flush()
        with open(ready_file, "w") as f:
            f.write(full_path)
        signal.pause()  # the parent SIGKILLs us here, mid-write
        return original(self, full_path, iter([data]), mode, encoding)

    _tier_files.TierDisk._write = half_write
    t = tier.Tier("ram", tier_dir, 64 * 2**20, Stats(None))
    t.put("victim", b"v" * 1_000_000)
    sys.exit(3)  # never reached


def read_windows(url: str, cache, barrier, items: list[int], epochs: int, queue) -> None:
    """A 'rank': read the given windows through the shared cache; report checksums and pid."""
    import zstore

    ds = zstore.WindowDataset(url, cache=cache, window_seconds=2.0, seed=5)
    barrier.wait()
    out = {}
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        for i in items:
            x = ds[i]
            out[(epoch, i)] = (
                x["item"],
                x["length"],
                x["wav"].numpy().tobytes(),
                x["act"].numpy().tobytes(),
            )
    queue.put((os.getpid(), out))


def rank_report(rank: int, fail_rank: int, barrier, queue) -> None:
    """Wait at the barrier and report ``rank``; rank ``fail_rank`` raises before the
    barrier instead, so the others wait there for it (for spawn_ranks' tests)."""
    if rank == fail_rank:
        raise ValueError(f"rank {rank} fails on purpose")
    barrier.wait()
    queue.put(rank)


def rank_without_report(rank: int, barrier, queue) -> None:
    """Return without a report from rank 1 (for spawn_ranks' tests)."""
    if rank != 1:
        queue.put(rank)


def in_flight_until_seen(flag: str, batch) -> list[int]:
    """A conversion task that says 1,000 bytes are in flight, waits until the converting
    process has shown them (it creates ``flag``), then takes them back."""
    import importlib
    import time

    tasks = importlib.import_module("zstore.convert._tasks")
    tasks.in_flight(1000)
    deadline = time.monotonic() + 120
    while not os.path.exists(flag):
        if time.monotonic() > deadline:
            raise TimeoutError("the converting process never showed the bytes in flight")
        time.sleep(0.01)
    tasks.in_flight(-1000)
    return [len(batch)]
