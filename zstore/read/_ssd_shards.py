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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from zstore.cache import Checked, TieredCache
from zstore.errors import IntegrityError
from zstore.format import EMPTY, ArrayLayout, decode_index
from zstore.read._maps import MappedValues

SUFFIX = "#W"
FORGET = 65536  # shard keys a process remembers the SSD tier lacks, before it asks again


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


class WholeShards:
    """The SSD tier's whole shard objects of one store, as this process maps them."""

    def __init__(self, url: str, tiers: TieredCache):
        assert tiers.ssd is not None
        self.url, self.tiers = url, tiers
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
        if not again and key in self._absent:
            return None
        got = self.values.get(key, lambda c: _index(self.url, layout, obj, c), again=again)
        if got is None:
            if len(self._absent) >= FORGET:
                self._absent.clear()
            self._absent.add(key)
            return None
        found = Held(got.view, got.checked.payload)
        for n in wanted:
            span = found.chunk(n)
            if span is not None and not got.checked.verify(*span):
                self.values.discard(key)  # corrupt in the tier: read the chunks anew
                return None
        self._absent.discard(key)
        return found

    def put(self, obj: str, data: bytes | memoryview) -> None:
        """Keep a shard object fetched whole (within the tier's budget and admission)."""
        key = self.key(obj)
        if self.tiers.ssd.put(key, data, blocked=True):  # type: ignore[union-attr]
            self._absent.discard(key)

    @contextlib.contextmanager
    def first_free(self, objs: list[str]) -> Iterator[tuple[list[str], set[str]]]:
        """Hold the node's fill locks of the objects no other holder has now; yields
        (those objects, the others).  A reader does not wait for another process's
        whole-shard fetch: it reads its window's chunks around it."""
        locks = self.tiers.fill_locks
        if locks is None:
            yield list(objs), set()
            return
        held: list[int] = []
        free: list[str] = []
        busy: set[str] = set()
        try:
            for obj in objs:
                fds = locks.acquire([self.key(obj)], wait=False)
                if fds is None:
                    busy.add(obj)
                else:
                    held += fds
                    free.append(obj)
            yield free, busy
        finally:
            locks.release(held)

    @contextlib.contextmanager
    def locked(self, objs: list[str]) -> Iterator[None]:
        """Hold the node's fill locks of these objects (one process fetches each)."""
        if self.tiers.fill_locks is None:
            yield
            return
        with self.tiers.fill_locks.hold(self.key(o) for o in objs):
            yield


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
