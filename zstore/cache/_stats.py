"""Cache counters shared by every process on the node.

Each process counts into its own small memory-mapped file (no lock, no syscall
per update); readers sum all files.  Files of processes that have exited are
folded into ``total.bin`` so the directory stays small.
"""

from __future__ import annotations

import fcntl
import os
import threading
from typing import Any

import numpy as np

from zstore.cache.files import fix_file, open_file
from zstore.cache.ownership import make_dir
from zstore.processes import alive

TIERS = ("ram", "ssd")
TIER_FIELDS = (
    "hits",
    "misses",
    "hit_bytes",
    "fills",
    "fill_bytes",
    "evictions",
    "bypassed",
    "corrupt",
    "errors",
)
#: Added later: kept after the first fields so counter files keep their slots.
LATER_TIER_FIELDS = ("rejected",)
FIELDS = (
    tuple(f"{t}_{f}" for t in TIERS for f in TIER_FIELDS)
    + ("origin_requests", "origin_bytes", "origin_errors")
    + tuple(f"{t}_{f}" for t in TIERS for f in LATER_TIER_FIELDS)
)
_INDEX = {name: i for i, name in enumerate(FIELDS)}
_OPENING = threading.Lock()  # a process's first count, from any of its threads
_SLOTS = 64  # room to add counters without changing the file size


class Stats:
    """This process's counters in ``directory``; ``Stats(None)`` counts in memory only."""

    def __init__(self, directory: str | None):
        self.directory = directory
        self._pid = -1
        self._counts: np.ndarray = np.zeros(_SLOTS, dtype=np.int64)
        # the counters as a memoryview: an increment is on every RAM hit's path, and
        # through it costs ~0.1 us, not ~1 us through numpy's scalar indexing
        self._view = memoryview(self._counts)  # type: ignore[arg-type]

    def _open(self) -> np.ndarray:
        with _OPENING:  # threads counting at once make the file once, and wait for it
            if self._pid == os.getpid():
                return self._counts
            self._counts = self._made(os.getpid())
            self._view = memoryview(self._counts)  # type: ignore[arg-type]
            # set last: another thread that sees this process's pid counts into the file
            # (set first, a thread's counts went to the old array while it was made, and
            # were lost)
            self._pid = os.getpid()
            return self._counts

    def _made(self, pid: int) -> np.ndarray:
        """This process's counters: a file in the directory, or memory only."""
        counts = np.zeros(_SLOTS, dtype=np.int64)
        if self.directory is None:
            return counts
        try:
            if make_dir(self.directory) is not None:
                return counts  # not a safe place: count in memory only
            fold(self.directory)
            path = os.path.join(self.directory, f"{pid}-{os.urandom(4).hex()}.bin")
            with os.fdopen(open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
                f.write(bytes(8 * _SLOTS))
            return np.memmap(path, dtype=np.int64, mode="r+", shape=(_SLOTS,))
        except OSError:
            return counts  # counting in memory is fine; the cache must not fail over its stats

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, state["directory"])

    def add(self, name: str, n: int = 1) -> None:
        if self._pid != os.getpid():
            self._open()
        self._view[_INDEX[name]] += n


def _read(path: str) -> np.ndarray:
    counts = np.zeros(_SLOTS, dtype=np.int64)
    try:
        data = np.fromfile(path, dtype=np.int64)
        counts[: min(_SLOTS, data.size)] = data[:_SLOTS]
    except (OSError, ValueError):
        pass
    return counts


def _pid(name: str) -> int | None:
    """The process a counter file ``<pid>-<random>.bin`` belongs to; None for others."""
    pid = name.split("-", 1)[0]
    return int(pid) if name.endswith(".bin") and pid.isdigit() else None


def fold(directory: str) -> None:
    """Add the counters of exited processes to ``total.bin`` and remove their files."""
    lock_path = os.path.join(directory, "lock")
    with os.fdopen(open_file(lock_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        total_path = os.path.join(directory, "total.bin")
        total = _read(total_path)
        dead = []
        for name in os.listdir(directory):
            pid = _pid(name)
            if pid is not None and not alive(pid):
                total += _read(os.path.join(directory, name))
                dead.append(name)
        if dead:
            tmp = f"{total_path}.{os.getpid()}.tmp"
            total.tofile(tmp)
            fix_file(tmp)
            os.replace(tmp, total_path)
            for name in dead:
                os.unlink(os.path.join(directory, name))


def live_processes(directory: str | None) -> set[int]:
    """The running processes that count into ``directory`` (the node's processes that
    have used its tiers; each makes its file on its first count)."""
    pids: set[int] = set()
    try:
        names = os.listdir(directory) if directory else []
    except OSError:
        return pids
    for name in names:
        pid = _pid(name)
        if pid is not None and alive(pid):
            pids.add(pid)
    return pids


MARK = "mark.counts"  # not .bin: a snapshot, not a process's counters


def _sum(directory: str | None, live_only: bool = False) -> np.ndarray:
    counts = np.zeros(_SLOTS, dtype=np.int64)
    if directory and os.path.isdir(directory):
        for name in os.listdir(directory):
            if not name.endswith(".bin"):
                continue
            pid = _pid(name)
            if live_only and not (pid is not None and alive(pid)):
                continue
            counts += _read(os.path.join(directory, name))
    return counts


def _named(counts: np.ndarray) -> dict[str, int]:
    return {name: int(counts[i]) for name, i in _INDEX.items()}


def read_stats(directory: str | None, *, live_only: bool = False) -> dict[str, int]:
    """Counters summed over every process that used the cache since it was last cleared
    (``live_only``: over the processes still running, e.g. the job now)."""
    return _named(_sum(directory, live_only))


def mark(directory: str | None) -> None:
    """Remember the counters now, so that stats can show what happened since."""
    if not directory or make_dir(directory) is not None:
        return
    path = os.path.join(directory, MARK)
    tmp = f"{path}.{os.getpid()}.tmp"
    _sum(directory).tofile(tmp)
    fix_file(tmp)
    os.replace(tmp, path)


def read_since_mark(directory: str | None) -> dict[str, int] | None:
    """Counters since the last :func:`mark`, or None without one."""
    if not directory or not os.path.exists(os.path.join(directory, MARK)):
        return None
    return _named(_sum(directory) - _read(os.path.join(directory, MARK)))


def summarize(counts: dict[str, int], usage: dict[str, Any]) -> dict[str, Any]:
    """Group raw counters by tier and add hit rates and on-disk bytes."""
    out: dict[str, Any] = {}
    for tier in TIERS:
        t: dict[str, Any] = {f: counts[f"{tier}_{f}"] for f in TIER_FIELDS + LATER_TIER_FIELDS}
        looked = t["hits"] + t["misses"]
        t["hit_rate"] = round(t["hits"] / looked, 4) if looked else 0.0
        t.update(usage.get(tier, {}))
        out[tier] = t
    out["origin"] = {
        "requests": counts["origin_requests"],
        "bytes": counts["origin_bytes"],
        "errors": counts["origin_errors"],
    }
    return out
