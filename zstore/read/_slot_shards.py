"""A shard of the RAM tier that the reads fill chunk by chunk (``ram_format="chunks"``):
its geometry and its mapped value (:class:`SlotShard`), a slot per inner chunk over the
decoded shard laid out as a whole decoded shard is (time rounded up to whole chunks).
The form that reads and writes them is :mod:`zstore.read._chunk_shards`."""

from __future__ import annotations

import math

import numpy as np
from crc32c import crc32c

from zstore.cache import TieredCache
from zstore.cache.slots import Slots
from zstore.format import ArrayLayout
from zstore.read._ram_form import form_key

#: the tier key's suffix of a shard in this form
SUFFIX = "#C"


def geometry(layout: ArrayLayout, s: int) -> tuple[int, int, tuple[int, int, int]]:
    """(slots, data bytes, (outer, time, inner)) of shard ``s``: a slot per inner chunk,
    the data the decoded shard in the RAM dtype with its time axis rounded up to whole
    chunks, as (everything before time, time, everything after) elements."""
    steps = min(layout.shard, layout.length - s * layout.shard)
    n = -(-steps // layout.chunk)
    axis, shape = layout.time_axis, layout.shape
    outer, inner = math.prod(shape[:axis]), math.prod(shape[axis + 1 :])
    return (
        n,
        outer * n * layout.chunk * inner * layout.ram_dtype.itemsize,
        (outer, n * layout.chunk, inner),
    )


class SlotShard:
    """A mapped shard value: its slots (:class:`zstore.cache.slots.Slots`), and the
    decoded shard they fill as an array (``array``: the shard's own length along time)."""

    def __init__(self, layout: ArrayLayout, s: int, payload: memoryview):
        n, data_nbytes, (outer, time, inner) = geometry(layout, s)
        self.slots = Slots(payload, n, data_nbytes)
        self.layout = layout
        self.outer, self.time, self.inner = outer, time, inner
        self.complete = False  # every slot written (seen by this process)
        isz = layout.ram_dtype.itemsize
        self._row = layout.chunk * inner * isz  # bytes of a chunk in one outer row
        self.chunk_bytes = outer * self._row
        shape = list(layout.shape)
        shape[layout.time_axis] = time
        full = np.frombuffer(self.slots.data, dtype=layout.ram_dtype, count=outer * time * inner)
        self._full = full.reshape(shape)
        steps = min(layout.shard, layout.length - s * layout.shard)
        cut = [slice(None)] * len(shape)
        cut[layout.time_axis] = slice(0, steps)
        self.array = self._full[tuple(cut)]

    def ranges(self, j: int) -> list[tuple[int, int]]:
        """Slot ``j``'s byte ranges in the data: the chunk's part of each outer row."""
        step = self.time * self.inner * self.layout.ram_dtype.itemsize
        return [(o * step + j * self._row, self._row) for o in range(self.outer)]

    def has(self, j: int) -> bool:
        """Whether chunk ``j`` of the shard is in the tier, whole and checked."""
        return self.slots.has(j, self.ranges(j))

    def holds(self, first: int, stop: int) -> bool:
        """Whether chunks ``first`` to ``stop - 1`` are all in the tier (each checked)."""
        if self.slots.all_checked(first, stop):
            return True
        return all(self.has(j) for j in range(first, stop))

    def chunk(self, j: int) -> np.ndarray:
        """Chunk ``j`` in the map (check :meth:`has` first): a view of the shard."""
        cut = [slice(None)] * self._full.ndim
        cut[self.layout.time_axis] = slice(j * self.layout.chunk, (j + 1) * self.layout.chunk)
        return self._full[tuple(cut)]

    def write(self, j: int, values: np.ndarray) -> bool:
        """Write chunk ``j`` (``values``: the chunk in the RAM dtype, C-contiguous)."""
        rows = values.reshape(self.outer, -1)
        parts = [(offset, rows[o].data.cast("B")) for o, (offset, _) in enumerate(self.ranges(j))]
        return self.slots.write(j, parts, crc32c(values.data.cast("B")))


def complete_in(tiers: TieredCache, layout: ArrayLayout, s: int) -> bool:
    """Whether the RAM tier holds every chunk of shard ``s`` of ``layout`` in the form
    the reads fill (``zstore cache stats --store``); nothing counted."""
    ram = tiers.ram
    if ram is None:
        return False
    got = ram.get_mapped(form_key(tiers, layout, s, SUFFIX), count_miss=False)
    if got is None or not got[0].slotted:
        return False
    try:
        shard = SlotShard(layout, s, got[0].payload)
    except ValueError:
        return False
    return bool(shard.slots.present.all())
