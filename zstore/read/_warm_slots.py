"""A shard object a job's reads left in the SSD tier in pieces, made whole for ``zstore
cache warm`` from those pieces and the ranges they lack, not fetched whole from the
origin again.

The pieces are the object's slots (:mod:`zstore.read._ssd_slots`, ``fetch="slots"``) or
a value per chunk and one for the shard index (``fetch="range"``: ``<obj>#r<start>-<stop>``,
``<obj>#s<n>``).  Warming a store whose SSD tier a job had filled so read every shard
object whole from the origin once more, and kept it beside the pieces of the same
object: the store downloaded twice and twice its bytes against the SSD budget
(tests/read/test_warm_slots.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from zstore.cache import TieredCache
from zstore.errors import IntegrityError
from zstore.format import EMPTY, ArrayLayout, decode_index
from zstore.origin import Request
from zstore.read._origin_fetch import index_key, range_key
from zstore.read._ssd_slots import EncodedShard, chunks_end

#: the most of an object's chunk bytes fetched as ranges; past it the object is read
#: whole (one request, not one per chunk)
MOST_FETCHED = 0.5

Read = Callable[[list[Request]], list[bytes | memoryview | None]]


def whole_from_slots(shard: EncodedShard, obj: str, read: Read, where: str) -> bytearray | None:
    """Shard object ``obj`` whole from its slots (each checked): see :func:`assemble`.
    None when the slot of the index is not written."""
    index = shard.index if shard.index is not None else shard.read_index(where)
    raw_index = shard.index_bytes()
    if index is None or raw_index is None:
        return None
    return assemble(
        shard.layout,
        obj,
        index,
        raw_index,
        lambda j: shard.chunk(j) if shard.has(j) else None,
        read,
    )


class RangeValues:
    """The values a job's reads by ranges (``fetch="range"``) left in the SSD tier for one
    shard object: its index and the chunks they hold (each checked as it is read; a
    damaged one is dropped and counts as not held)."""

    def __init__(self, tiers: TieredCache, layout: ArrayLayout, obj: str, where: str):
        self.layout, self.obj, self.tiers = layout, obj, tiers
        self.index: np.ndarray | None = None
        self.raw_index: bytes | memoryview | None = None
        self.chunks: dict[int, memoryview] = {}
        #: the tier's names of the values found (removed once the object is whole)
        self.names: list[str] = []
        ssd = tiers.ssd
        if ssd is None:
            return
        name = tiers.key(index_key(obj, layout))
        raw = ssd.get(name, count_miss=False)
        if raw is None:
            return
        self.names.append(name)
        try:
            index = decode_index(layout, raw, where)
        except IntegrityError:
            return
        self.index, self.raw_index = index, raw
        wanted = [j for j in range(layout.chunks_per_shard) if index[j][0] != EMPTY]
        names = [
            tiers.key(range_key(obj, int(index[j][0]), int(index[j][0] + index[j][1])))
            for j in wanted
        ]
        for j, name, value in zip(wanted, names, ssd.get_many(names, count_miss=False)):
            if value is not None:
                self.chunks[j] = value
                self.names.append(name)

    def remove(self) -> None:
        """Remove the values found (the object is whole in the tier now).  Processes read
        them, never map them: nothing to log for unmapping."""
        ssd = self.tiers.ssd
        if ssd is None:
            return
        for name in self.names:
            ssd.remove(name, mapped=False)

    def whole(self, read: Read) -> bytearray | None:
        """The object whole (:func:`assemble`); None when the index was not found or no
        chunk was."""
        if self.index is None or self.raw_index is None or not self.chunks:
            return None
        return assemble(self.layout, self.obj, self.index, self.raw_index, self.chunks.get, read)


def assemble(
    layout: ArrayLayout,
    obj: str,
    index: np.ndarray,
    raw_index: bytes | memoryview,
    held: Callable[[int], bytes | memoryview | None],
    read: Read,
) -> bytearray | None:
    """Shard object ``obj`` whole: each chunk ``held`` gives at its place, the others
    fetched from the origin by their ranges in one round (``read``), the shard index
    (``raw_index``) after them.  None when more than MOST_FETCHED of the chunk bytes
    would be fetched, or when the origin lacks a range: then the caller reads the object
    whole."""
    end = chunks_end(index)
    out = bytearray(end + layout.index_bytes)
    missing: list[tuple[int, int]] = []
    total = 0
    for j in range(layout.chunks_per_shard):
        if index[j][0] == EMPTY:
            continue
        offset, nbytes = int(index[j][0]), int(index[j][1])
        total += nbytes
        data = held(j)
        if data is not None and len(data) == nbytes:
            out[offset : offset + nbytes] = data
        else:
            missing.append((offset, nbytes))
    if sum(n for _, n in missing) > MOST_FETCHED * total:
        return None
    got = read([(obj, offset, offset + nbytes) for offset, nbytes in missing]) if missing else []
    for (offset, nbytes), data in zip(missing, got):
        if data is None or len(data) != nbytes:
            return None
        out[offset : offset + nbytes] = data
    out[end:] = raw_index
    return out
