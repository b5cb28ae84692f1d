"""A shard object the SSD tier holds as slots (:mod:`zstore.read._ssd_slots`, filled by
a job's reads), made whole for ``zstore cache warm`` from those slots and the ranges
they lack, not fetched whole from the origin again.

Warming a store whose SSD tier a job had filled by ranges read every shard object whole
from the origin once more, and kept it beside the slotted value of the same object:
the store downloaded twice and twice its bytes against the SSD budget
(tests/read/test_warm_slots.py).
"""

from __future__ import annotations

from collections.abc import Callable

from zstore.format import EMPTY, ArrayLayout
from zstore.origin import Request
from zstore.read._ssd_slots import EncodedShard, chunks_end

#: the most of an object's chunk bytes fetched as ranges; past it the object is read
#: whole (one request, not one per chunk)
MOST_FETCHED = 0.5


def whole_from_slots(
    shard: EncodedShard,
    obj: str,
    read: Callable[[list[Request]], list[bytes | memoryview | None]],
    where: str,
) -> bytearray | None:
    """Shard object ``obj`` whole: each chunk its slot holds (checked) at its place, the
    others fetched from the origin by their ranges in one round (``read``), and the
    shard index from its slot after them.  None when the slot of the index is not
    written, when more than MOST_FETCHED of the chunk bytes would be fetched, or when
    the origin lacks a range: then the caller reads the object whole."""
    layout: ArrayLayout = shard.layout
    index = shard.index if shard.index is not None else shard.read_index(where)
    raw_index = shard.index_bytes()
    if index is None or raw_index is None:
        return None
    end = chunks_end(index)
    out = bytearray(end + layout.index_bytes)
    missing: list[tuple[int, int]] = []
    total = 0
    for j in range(layout.chunks_per_shard):
        if index[j][0] == EMPTY:
            continue
        offset, nbytes = int(index[j][0]), int(index[j][1])
        total += nbytes
        if shard.has(j):
            out[offset : offset + nbytes] = shard.chunk(j)
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
