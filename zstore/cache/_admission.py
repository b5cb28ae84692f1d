"""Admission for a full tier: keep a stable resident set under random access.

Under uniform random windows no cache hits more often than budget / data, whatever it
evicts; evicting on every miss only adds the cost of filling what is evicted next
(measured: a decoded RAM tier at a third of the data built 2.8x the bytes it served
and read 24 windows/s, see docs/benchmarks.md).  So once a tier is full, a new value
displaces resident ones only when it is clearly used more often than they are
(TinyLFU-style).  Access counts live in a node-shared count-min sketch, a small file
in the tier's directory that every process maps; counts are halved every ``period``
accesses, so a changed access pattern (another subset, another store) wins its place
within a few periods.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import mmap
import os
from typing import Any

import numpy as np

from zstore.cache.files import make_new

ROWS = 4
HEADER = 16  # uint64 accesses since the last halving, uint64 period
MIN_PERIOD = 4096
KNOWN_KEYS = 1 << 16  # keys whose counters a sketch remembers (cleared when full)


def sketch_width(budget: int) -> int:
    """Counters per row for a tier of ``budget`` bytes: about one per 64 KiB of budget
    (values are rarely smaller), from 1,024 to 2**20 (8 KiB to 8 MiB of sketch)."""
    want = max(1, budget // 65536)
    return min(1 << 20, max(1024, 1 << (want - 1).bit_length()))


def sketch_bytes(width: int) -> int:
    return HEADER + ROWS * width * 2


@functools.lru_cache(maxsize=1 << 16)
def _slots(raw: bytes, width: int) -> tuple[int, ...]:
    """A key's counters, one per row (cached: a RAM hit touches its key each time, and
    the keys of a store's shards repeat)."""
    h = int.from_bytes(hashlib.blake2b(raw, digest_size=4 * ROWS).digest(), "little")
    return tuple(r * width + ((h >> (32 * r)) & 0xFFFFFFFF) % width for r in range(ROWS))


class FrequencySketch:
    """Approximate access counts of keys, shared by every process on the node.

    Increments race without a lock (a lost increment only blurs an estimate); halving
    takes a non-blocking flock so two processes do not halve at once.
    """

    def __init__(self, directory: str, width: int):
        self.path = os.path.join(directory, "frequency.bin")
        self.width = width  # for a new sketch; an existing one keeps its own
        self._pid = -1
        self._map: mmap.mmap | None = None
        self._counts: memoryview | None = None
        self._head: memoryview | None = None
        self._known: dict[str | bytes, tuple[int, ...]] = {}  # keys' counters, this width
        self._width = 0
        self._fd = -1

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": os.path.dirname(self.path), "width": self.width}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, state["directory"], state["width"])

    def _open(self) -> bool:
        if self._pid == os.getpid():
            return self._counts is not None
        mapped = self._mapped()
        if mapped is None:
            self._counts = None
        else:
            self._map, self._fd, self._width = mapped
            # memoryviews, not numpy: a touch is on the hot path (a few us, not tens)
            self._head = memoryview(self._map)[:HEADER].cast("Q")
            self._known.clear()
            self._counts = memoryview(self._map)[HEADER:].cast("H")
        # set last: a thread that sees this process's pid uses the map, the width and
        # the counts above.  Set first, a second thread's first touch, while the first was
        # still opening the file, was not counted, or found the counts with no width yet.
        self._pid = os.getpid()
        return mapped is not None

    def _mapped(self) -> tuple[mmap.mmap, int, int] | None:
        """(map, descriptor, width) of the node's sketch, made now if there is none
        yet; None where it cannot be used."""
        try:
            if not os.path.exists(self.path):
                make_new(self.path, self._allocated)
            fd = os.open(self.path, os.O_RDWR)
            size = os.fstat(fd).st_size
            width = (size - HEADER) // (2 * ROWS)
            try:  # one an older zstore left sparse: allocate it (a no-op when it is)
                if width >= 1 and size == sketch_bytes(width):
                    os.posix_fallocate(fd, 0, size)
            except OSError:
                width = 0
            if width < 1 or size != sketch_bytes(width):
                os.close(fd)
                return None
            return mmap.mmap(fd, size), fd, width
        except OSError:
            return None

    def _allocated(self, tmp: str) -> None:
        """A new sketch at ``tmp``, every block allocated now: a sparse file written
        through a map dies of SIGBUS when the tmpfs fills up."""
        with open(tmp, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, sketch_bytes(self.width))

    def _slots(self, key: str | bytes) -> tuple[int, ...]:
        found = self._known.get(key)  # a RAM hit touches its key: skip encoding it
        if found is None:
            if len(self._known) >= KNOWN_KEYS:
                self._known.clear()
            raw = key if isinstance(key, bytes) else str(key).encode()
            found = self._known[key] = _slots(raw, self._width)
        return found

    def touch(self, key: str) -> None:
        """Count one access of ``key``."""
        if not self._open():
            return
        counts, head = self._counts, self._head
        for i in self._slots(key):
            if counts[i] < 65535:  # type: ignore[index]
                counts[i] += 1  # type: ignore[index]
        head[0] += 1  # type: ignore[index]
        if head[0] >= max(head[1], MIN_PERIOD):  # type: ignore[index]
            self._halve()

    def touch_many(self, keys: list[str]) -> None:
        """:meth:`touch` of each of ``keys`` (a batch's shard hits)."""
        if not keys or not self._open():
            return
        counts, head = self._counts, self._head
        for key in keys:
            for i in self._slots(key):
                if counts[i] < 65535:  # type: ignore[index]
                    counts[i] += 1  # type: ignore[index]
        head[0] += len(keys)  # type: ignore[index]
        if head[0] >= max(head[1], MIN_PERIOD):  # type: ignore[index]
            self._halve()

    def estimate(self, key: str | bytes) -> int:
        """How often ``key`` was accessed lately (an overestimate at worst)."""
        if not self._open():
            return 0
        counts = self._counts
        return min(counts[i] for i in self._slots(key))  # type: ignore[index]

    def set_period(self, accesses: int) -> None:
        """Halve the counts every ``accesses`` accesses (about 10x the resident entries)."""
        if self._open():
            self._head[1] = max(int(accesses), MIN_PERIOD)  # type: ignore[index]

    def _halve(self) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # another process is halving
        try:
            if self._head[0] >= max(self._head[1], MIN_PERIOD):  # type: ignore[index]
                assert self._map is not None
                counts = np.frombuffer(self._map, dtype=np.uint16, offset=HEADER)
                counts >>= 1
                del counts
                self._head[0] = 0  # type: ignore[index]
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def admit(candidate: int, victims: list[int]) -> bool:
    """Whether a value used ``candidate`` times lately displaces values used ``victims``
    times: only when clearly more popular than the most popular of them, so random
    access, where every value is about as popular, leaves the resident set alone."""
    return not victims or candidate > 2 * max(victims) + 1
