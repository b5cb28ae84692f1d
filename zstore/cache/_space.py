"""Room in a tier: its byte budget, which resident values a newcomer displaces, and
deleting them.

Values are evicted oldest stored first, inside the insert's SQLite transaction, before
the insert.  With admission (RAM tiers) a full tier keeps its resident values unless
the newcomer was used clearly more often lately than they were, as counted by the
node-shared sketch of :mod:`zstore.cache._admission`: under random windows, evicting on
every miss only adds the cost of building what is evicted next.
"""

from __future__ import annotations

import os
import time
from typing import Any

import diskcache

from zstore.cache._admission import FrequencySketch, admit, sketch_bytes, sketch_width
from zstore.cache._stats import Stats
from zstore.cache.value import header_size

PAGE = 4096
REFUSAL_FRESH = 1.0  # seconds a process trusts its last look at a full tier's oldest values


def rounded(n: int) -> int:
    """``n`` bytes rounded up to whole pages (what a value file takes on disk)."""
    return -(-n // PAGE) * PAGE


class Refused(Exception):
    """Admission refused a value (aborts the insert's transaction)."""


class Room:
    """The budget of the tier in ``directory`` and who gives way in it."""

    def __init__(self, name: str, directory: str, budget: int, stats: Stats, admission: bool):
        self.name, self.directory, self.budget, self.stats = name, directory, budget, stats
        self.reserve = min(2 * 2**20, budget // 4)  # SQLite WAL, -shm, directories
        self.sketch: FrequencySketch | None = None
        self._floor: tuple[int, float] | None = None  # see admits_as()
        if admission:
            width = sketch_width(budget)
            self.sketch = FrequencySketch(directory, width)
            self.reserve += rounded(sketch_bytes(width))

    def need(self, nbytes: int, *, blocked: bool = False) -> int:
        """Bytes on disk of a value of ``nbytes`` (header and page rounding included)."""
        return rounded(header_size(nbytes, blocked=blocked) + nbytes)

    def fits(self, nbytes: int, *, blocked: bool = False) -> bool:
        """Whether a value of ``nbytes`` can be stored at all (else it bypasses the tier)."""
        return self.need(nbytes, blocked=blocked) + self.reserve <= self.budget

    def has_room(self, cache: diskcache.Cache, need: int) -> bool:
        """Whether ``need`` more bytes fit in the free room now, evicting nothing."""
        return self._excess(cache, need) <= 0

    def _excess(self, cache: diskcache.Cache, need: int) -> int:
        """Bytes to evict before ``need`` more fit in the budget (its reserve kept)."""
        return int(cache.volume() + need - (self.budget - self.reserve))

    def admits_as(
        self, cache: diskcache.Cache, key: str, nbytes: int, *, blocked: bool = False
    ) -> str | None:
        """``"room"`` (a value of ``nbytes`` fits in the free room), ``"displace"``
        (admission lets it displace resident values) or None (refused)."""
        # A full tier refuses most newcomers: while the last look at its oldest values
        # is fresh, a newcomer no more popular than they were is refused without
        # asking SQLite (under random access that is most misses of a window).
        floor = self._floor
        if (
            self.sketch is not None
            and floor is not None
            and time.monotonic() - floor[1] < REFUSAL_FRESH
            and not admit(self.sketch.estimate(key), [floor[0]])
        ):
            return None
        victims = self.victims(cache, cache._sql, key, self.need(nbytes, blocked=blocked))
        if victims is None:
            return None
        return "displace" if victims else "room"

    def victims(
        self, cache: diskcache.Cache, sql: Any, key: str, need: int
    ) -> list[tuple[int, str]] | None:
        """The values to evict so that ``need`` more bytes fit (oldest stored first), or
        None when admission refuses (the newcomer is not clearly used more than they are)."""
        excess = self._excess(cache, need)
        if excess <= 0:
            return []
        rows = sql(
            "SELECT rowid, filename, size, key FROM Cache ORDER BY store_time LIMIT 64"
        ).fetchall()
        victims, counts = [], []
        for rowid, filename, size, victim in rows:
            victims.append((rowid, filename))
            excess -= size
            if self.sketch is not None:
                counts.append(self.sketch.estimate(victim))
            if excess <= 0:
                break
        if self.sketch is not None and not admit(self.sketch.estimate(key), counts):
            self._floor = (min(counts, default=0), time.monotonic())
            return None
        self._floor = None
        return victims

    def make(
        self, cache: diskcache.Cache, sql: Any, cleanup: Any, need: int, key: str
    ) -> list[int]:
        """Delete values until ``need`` more bytes fit; their inodes.  Raises
        :class:`Refused` when admission keeps the resident values."""
        excess = self._excess(cache, need)
        inodes: list[int] = []
        while excess > 0:
            victims = self.victims(cache, sql, key, need)
            if victims is None:
                raise Refused  # rolls back what this transaction deleted so far
            if not victims:
                break
            sql("DELETE FROM Cache WHERE rowid IN (%s)" % ",".join(str(r) for r, _ in victims))
            for _, filename in victims:
                try:
                    inodes.append(os.stat(os.path.join(self.directory, filename)).st_ino)
                except OSError:
                    pass
                cleanup(filename)
            self.stats.add(f"{self.name}_evictions", len(victims))
            excess = self._excess(cache, need)
        return inodes
