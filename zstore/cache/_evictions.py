"""A node-wide log of evicted value files, so processes unmap them promptly.

Evicting a file that other processes have mapped frees nothing until they unmap it.
Every eviction appends the file's inode to a ring in ``<tier>/evicted.ring``; a
reader compares the ring's head with its own position on each hit (one memory read,
no syscall) and drops the maps of the inodes added since.  An eviction is appended
after its files are unlinked (so a reader that mapped one of them before the unlink
finds it in the log afterwards); appends are serialized by an flock on the ring file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

import numpy as np

from zstore.cache.files import make_new
from zstore.cache.ownership import make_dir

SLOTS = 4096


class EvictionLog:
    """The ring of evicted inodes for one tier directory (opened lazily per process)."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, "evicted.ring")
        self._pid = -1
        self._ring: np.ndarray | None = None
        self._head: memoryview | None = None

    def _open(self) -> np.ndarray | None:
        if self._pid == os.getpid():
            return self._ring
        ring = self._mapped()
        self._ring = ring
        self._head = memoryview(ring)[:1] if ring is not None else None  # type: ignore[arg-type]
        # set last: a thread that sees this process's pid records into the ring above.
        # Set first, a second thread's eviction, while the first was still opening it,
        # went unrecorded (other processes kept the evicted files mapped).
        self._pid = os.getpid()
        return ring

    def _mapped(self) -> np.ndarray | None:
        """The node's ring, made now if there is none yet; None where it cannot be."""
        try:
            if make_dir(os.path.dirname(self.path)) is not None:
                return None
            if not os.path.exists(self.path):
                make_new(self.path, np.zeros(SLOTS + 1, dtype=np.int64).tofile)
            return np.memmap(self.path, dtype=np.int64, mode="r+", shape=(SLOTS + 1,))
        except (OSError, ValueError):
            return None  # without the log, evicted maps go when the map LRU drops them

    def head(self) -> int:
        """The ring's head (every RAM hit checks it: read through a memoryview, ~0.1 us,
        not numpy's scalar indexing, ~1 us)."""
        if self._pid != os.getpid():
            self._open()
        return self._head[0] if self._head is not None else 0

    def record(self, inodes: list[int]) -> None:
        ring = self._open()
        if ring is None or not inodes:
            return
        with self._locked():
            head = int(ring[0])
            for ino in inodes:
                ring[1 + head % SLOTS] = ino
                head += 1
            ring[0] = head  # published after the slots

    def forget_all(self) -> None:
        """Make every reader drop all its maps (after the tier was cleared)."""
        ring = self._open()
        if ring is not None:
            with self._locked():
                ring[0] = int(ring[0]) + SLOTS + 1

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the ring's writer lock (an flock, released when the file is closed)."""
        with open(self.path, "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def since(self, position: int) -> tuple[int, list[int] | None]:
        """(new position, inodes evicted since ``position``); None: too many, drop all."""
        ring = self._open()
        if ring is None:
            return position, []
        head = int(ring[0])
        if head - position > SLOTS or head < position:
            return head, None
        return head, [int(ring[1 + i % SLOTS]) for i in range(position, head)]
