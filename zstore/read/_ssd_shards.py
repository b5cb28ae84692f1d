"""Whole shard objects in the SSD tier, mapped once per process.

A shard object fetched whole (``fetch="shard"``, ``zstore cache warm``) is kept in the
SSD tier as one value: its bytes as the origin holds them (the chunks, then the shard
index).  A process maps it once and then reads any of its chunks by slicing the map,
so an SSD hit costs the decode of the window's chunks and little else: no lookup, no
open and no read per chunk.  (Kept as one value per chunk, as ``fetch="range"`` fills
the tier, a window's ~20 chunks cost ~1 ms in lookups, opens and reads on top of
their decode: measured, see docs/benchmarks-notes.md.)

The value is stored *blocked* (a crc32c per 128 KiB), so a process checks the blocks
it reads the first time it reads them; a block that fails drops the value and the
window's chunks are read the ordinary way.

A read that fetches a shard whole does not write it in front of itself: the object is
handed, with the node's fill lock for it, to a thread of its own behind the reads
(``zstore.read._builds``), which writes it and releases the lock.  Until then this
process reads it from memory, and other processes read their windows' ranges around
it.  On a cold NFS-like origin the write (a 7 MB shard per first touch) was most of
what the first batch cost on top of no tiers.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any

import numpy as np

from zstore.cache import Checked, TieredCache
from zstore.errors import IntegrityError
from zstore.format import EMPTY, ArrayLayout, decode_index
from zstore.read._builds import FORK_GATE, BehindBuilds
from zstore.read._maps import MappedValues

SUFFIX = "#W"
FORGET = 65536  # shard keys a process remembers the SSD tier lacks, before it asks again

#: Shard objects fetched whole that this process holds in memory, by (SSD tier
#: directory, key): while their SSD write is queued behind the reads, and while a queued
#: RAM fill holds their chunks (``keep``).  This process reads them from memory until
#: both are done: a read from the SSD tier right after the write comes from the device
#: (the write goes around the page cache), and in a cold NFS-like first epoch those
#: reads took ~0.15 s of one rank's reading thread (docs/benchmarks-notes.md).
_AT_HAND: dict[tuple[str, str], Held] = {}
_HOLDERS: collections.Counter[tuple[str, str]] = collections.Counter()
_AT_HAND_LOCK = threading.Lock()


def _forget_all() -> None:
    _AT_HAND.clear()
    _HOLDERS.clear()


os.register_at_fork(after_in_child=_forget_all)  # the child writes and fills none of them


class Held:
    """The chunks of one shard object at hand: its index and its bytes (a map of the
    SSD tier's value, or the object just fetched)."""

    __slots__ = ("index", "payload")

    def __init__(self, index: np.ndarray, payload: memoryview | bytes):
        self.index, self.payload = index, payload

    def chunk(self, n: int) -> tuple[int, int] | None:
        """(start, stop) of chunk ``n`` in the object; None when it was never written."""
        offset, nbytes = self.index[n]
        if offset == EMPTY:
            return None
        return int(offset), int(offset + nbytes)


#: (layout, chunk numbers wanted) by shard object
Wanted = dict[str, tuple[ArrayLayout, list[int]]]


class WholeShards:
    """The SSD tier's whole shard objects of one store, as this process maps them."""

    def __init__(self, url: str, tiers: TieredCache, behind: BehindBuilds | None = None):
        assert tiers.ssd is not None
        self.url, self.tiers = url, tiers
        #: where a read's whole-shard writes go (None: written in the read)
        self.behind = behind
        self.values = MappedValues(tiers.ssd)
        self._absent: set[str] = set()

    def key(self, obj: str) -> str:
        return self.tiers.key(f"{obj}{SUFFIX}")

    def held(
        self, layout: ArrayLayout, obj: str, wanted: list[int], *, again: bool = False
    ) -> Held | None:
        """Shard object ``obj`` from this process's map of the tier's value, with the
        blocks of chunks ``wanted`` checked; None when the tier lacks it (remembered,
        unless ``again``: a recheck under the fill lock) or a check fails (dropped)."""
        key = self.key(obj)
        writing = _AT_HAND.get(self._slot(key))
        if writing is not None:
            return writing
        if not again and key in self._absent:
            return None
        got = self.values.get(key, lambda c: _index(self.url, layout, obj, c), again=again)
        if got is None:
            if len(self._absent) >= FORGET:
                self._absent.clear()
            self._absent.add(key)
            return None
        found = Held(got.view, got.checked.payload)
        spans = [span for span in map(found.chunk, wanted) if span is not None]
        for start, stop in _runs(spans):  # read ahead, not a device read per page
            got.checked.prefetch(start, stop)
        for span in spans:
            if not got.checked.verify(*span):
                self.values.discard(key)  # corrupt in the tier: read the chunks anew
                return None
        self._absent.discard(key)
        return found

    def in_memory(self, obj: str) -> Held | None:
        """Shard object ``obj`` when this process holds it fetched whole, its SSD write
        or a RAM fill of it still queued (else None, even when the tier holds it)."""
        return _AT_HAND.get(self._slot(self.key(obj)))

    def keep(self, objs: Iterable[str]) -> list[str]:
        """Keep those of ``objs`` this process holds in memory there until
        :meth:`let_go` (a queued RAM fill holds their chunks); the ones kept."""
        kept = []
        with _AT_HAND_LOCK:
            for obj in objs:
                where = self._slot(self.key(obj))
                if where in _AT_HAND:
                    _HOLDERS[where] += 1
                    kept.append(obj)
        return kept

    def let_go(self, objs: Iterable[str]) -> None:
        """Undo :meth:`keep` of ``objs``."""
        with _AT_HAND_LOCK:
            for obj in objs:
                _let_go(self._slot(self.key(obj)))

    def held_many(self, wanted: Wanted, *, again: bool = False) -> dict[str, Held]:
        """:meth:`held` for each shard object of ``wanted``, under the maps' lock (this
        process's unmapping thread edits them): those found."""
        found: dict[str, Held] = {}
        with self.values.lock:
            for obj, (layout, chunks) in wanted.items():
                got = self.held(layout, obj, chunks, again=again)
                if got is not None:
                    found[obj] = got
        return found

    def put(self, obj: str, data: bytes | memoryview) -> None:
        """Keep a shard object fetched whole (within the tier's budget and admission)."""
        key = self.key(obj)
        if self.tiers.ssd.put(key, data, blocked=True):  # type: ignore[union-attr]
            self._absent.discard(key)

    def put_behind(self, obj: str, held: Held, fds: list[int]) -> bool:
        """Queue the SSD write of ``obj`` (fetched whole: ``held``) behind the reads,
        with the node's fill lock ``fds``, which the write releases; False when there
        is no room (the caller writes it and keeps the lock)."""
        if self.behind is None:
            return False
        key = self.key(obj)
        where = self._slot(key)
        with _AT_HAND_LOCK:
            _AT_HAND[where] = held
            _HOLDERS[where] += 1
        if self.behind.submit(key, partial(self._write, obj, held, fds), len(held.payload)):
            return True
        with _AT_HAND_LOCK:
            _let_go(where)
        return False

    def _slot(self, key: str) -> tuple[str, str]:
        """``key``'s place in ``_AT_HAND`` (two caches of one store share keys)."""
        return self.values.tier.directory, key

    def _write(self, obj: str, held: Held, fds: list[int], done: Any) -> None:
        """In the writes' thread: write ``obj`` to the SSD tier, release its lock."""
        try:
            with FORK_GATE.held():  # SQLite and the file write
                self.put(obj, held.payload)
        finally:
            with _AT_HAND_LOCK:
                _let_go(self._slot(self.key(obj)))
            if self.tiers.fill_locks is not None:
                self.tiers.fill_locks.release(fds)

    @contextlib.contextmanager
    def first_free(self, objs: list[str]) -> Iterator[tuple[dict[str, list[int]], set[str]]]:
        """Hold the node's fill locks of the objects no other holder has now; yields
        ({those objects: their lock descriptors}, the others).  A reader does not wait
        for another process's whole-shard fetch: it reads its window's chunks around it.
        The locks still in the dict are released on exit (take one out to keep it)."""
        locks = self.tiers.fill_locks
        free: dict[str, list[int]] = {}
        busy: set[str] = set()
        if locks is None:
            yield {obj: [] for obj in objs}, busy
            return
        try:
            for obj in objs:
                fds = locks.acquire([self.key(obj)], wait=False)
                if fds is None:
                    busy.add(obj)
                else:
                    free[obj] = fds
            yield free, busy
        finally:
            for fds in free.values():
                locks.release(fds)

    @contextlib.contextmanager
    def locked(self, objs: list[str]) -> Iterator[None]:
        """Hold the node's fill locks of these objects (one process fetches each)."""
        if self.tiers.fill_locks is None:
            yield
            return
        with self.tiers.fill_locks.hold(self.key(o) for o in objs):
            yield


def _let_go(where: tuple[str, str]) -> None:
    """One holder of ``where`` is done with it (under _AT_HAND_LOCK)."""
    _HOLDERS[where] -= 1
    if _HOLDERS[where] <= 0:
        del _HOLDERS[where]
        _AT_HAND.pop(where, None)


def _runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges ``spans`` merged where they touch (a window's chunks lie one after
    another in their shard object)."""
    runs: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if runs and start <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], stop))
        else:
            runs.append((start, stop))
    return runs


def _index(url: str, layout: ArrayLayout, obj: str, checked: Checked) -> Any:
    """The shard index at the end of a mapped object; None when it is corrupt."""
    size = len(checked.payload)
    if size < layout.index_bytes or not checked.verify(size - layout.index_bytes, size):
        return None
    try:
        return decode_index(
            layout,
            checked.payload[size - layout.index_bytes :],
            f"{url}: {obj} (whole shard in the SSD tier)",
        )
    except IntegrityError:
        return None
