"""Upkeep of a tier directory: the budget its users run with (for `zstore cache stats`),
a sweep of value files left by killed writers, and the bytes it takes on disk."""

from __future__ import annotations

import json
import os
import time

import diskcache

from zstore.cache.files import open_file, write_json

BUDGET_FILE = "budget.json"
SWEEP_EVERY = 600.0  # seconds between sweeps of a tier directory


def record_budget(directory: str, budget: int) -> None:
    """Write ``budget`` where `zstore cache stats` finds it (when it changed)."""
    path = os.path.join(directory, BUDGET_FILE)
    try:
        with open(path) as f:
            if json.load(f).get("budget") == budget:
                return
    except (OSError, ValueError):
        pass
    write_json(path, {"budget": budget})


def recorded_budget(directory: str) -> int | None:
    """The budget the processes using the tier last ran with (None: not known)."""
    try:
        with open(os.path.join(directory, BUDGET_FILE)) as f:
            return int(json.load(f)["budget"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def sweep_if_due(cache: diskcache.Cache | None, directory: str, every: float = SWEEP_EVERY) -> None:
    """Sweep when the last sweep of ``directory`` (by any process) is ``every`` seconds old."""
    mark = os.path.join(directory, "swept")
    try:
        if time.time() - os.stat(mark).st_mtime < every:
            return
    except FileNotFoundError:
        pass
    os.close(open_file(mark, os.O_WRONLY | os.O_CREAT))
    os.utime(mark)
    sweep(cache, directory)


def sweep(cache: diskcache.Cache | None, directory: str, min_age: float = 60.0) -> int:
    """Remove value files no index row refers to (left by killed writers); how many."""
    if cache is None:
        return 0
    known = {row[0] for row in cache._sql("SELECT filename FROM Cache").fetchall()}
    now, removed = time.time(), 0
    for sub in os.listdir(directory):
        subdir = os.path.join(directory, sub)
        if len(sub) != 2 or not os.path.isdir(subdir):
            continue
        for name in os.listdir(subdir):
            rel, full = os.path.join(sub, name), os.path.join(subdir, name)
            try:
                if rel not in known and now - os.stat(full).st_mtime > min_age:
                    os.unlink(full)
                    removed += 1
            except FileNotFoundError:
                pass
    return removed


def bytes_on_disk(directory: str) -> int:
    """Bytes the files under ``directory`` take on disk (values, index, WAL)."""
    used = 0
    for dirpath, _, files in os.walk(directory):
        for f in files:
            try:
                used += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return used
