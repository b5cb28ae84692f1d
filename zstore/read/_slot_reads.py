"""The part of :class:`zstore.read._chunks.ChunkSource` that reads through the SSD tier's
slotted shards (:mod:`zstore.read._ssd_slots`): a chunk the tier holds comes from its
slot; the others are fetched in one origin round past the tiers' lookups and locks,
and each is written into its slot once it decodes, in the thread that decodes it (the
window copy's), not in front of the next read: written in the reading thread, the
first epoch's writes and the values' first touches took ~0.12 s of one rank's
reading thread (NFS-like origin; docs/benchmarks-notes.md, "The SSD tier filled by
the reads")."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from zstore.format import ArrayLayout
from zstore.origin import Request
from zstore.read._ssd_slots import EncodedShard, SlottedShards

if TYPE_CHECKING:
    from zstore.cache import TieredCache

#: chunks fetched for the SSD tier's slots and not decoded yet that a source remembers
MAX_SLOT_WRITES = 65536
#: where a chunk fetched for the SSD tier's slots goes: (object, layout, index, chunk)
SlotWrite = tuple[str, ArrayLayout, np.ndarray, int]
#: a read's chunks: (the request each came from, its bytes)
Out = list[tuple[Request | None, bytes | memoryview | None]]


class SlotReads:
    """Chunks through the SSD tier's slotted shards, for ``ChunkSource``."""

    if TYPE_CHECKING:
        tiers: TieredCache | None

        def _read(self, requests: list[Request]) -> list[bytes | memoryview | None]: ...

    slotted: SlottedShards | None

    def _start_slots(self, slotted: SlottedShards | None) -> None:
        self.slotted = slotted
        #: chunks fetched for their slots, by request, until they are decoded
        self._slot_writes: dict[Request, SlotWrite] = {}
        #: this read's: (slot in out, request, where it goes); hits and their bytes
        self._direct: list[tuple[int, Request, SlotWrite]] = []
        self._slot_hits = [0, 0]
        self._slotted: dict[str, EncodedShard | None] = {}

    def _slot_chunk(
        self, out: Out, i: int, request: Request, layout: ArrayLayout, index: np.ndarray, j: int
    ) -> None:
        """Chunk ``j`` of shard object ``request[0]`` into ``out[i]`` from its slot, or
        marked to be fetched by :meth:`_slotted_ranges`."""
        assert self.slotted is not None
        obj = request[0]
        if obj not in self._slotted:
            self._slotted[obj] = self.slotted.held(obj, layout, index)
        shard = self._slotted[obj]
        if shard is not None and shard.has(j):
            out[i] = (request, shard.chunk(j))
            self._slot_hits[0] += 1
            self._slot_hits[1] += int(request[2] or 0) - int(request[1] or 0)
        else:
            self._direct.append((i, request, (obj, layout, index, j)))

    def _slotted_ranges(self, out: Out) -> None:
        """Fetch the chunks :meth:`_slot_chunk` marked (one origin round), to be written
        into their slots as they decode (:meth:`keep`)."""
        direct, (hits, hit_bytes) = self._direct, self._slot_hits
        self._direct, self._slot_hits, self._slotted = [], [0, 0], {}
        if self.tiers is None:
            return
        stats = self.tiers.stats
        if hits:
            stats.add("ssd_hits", hits)
            stats.add("ssd_hit_bytes", hit_bytes)
        if not direct:
            return
        stats.add("ssd_misses", len(direct))
        got = self._read([request for _, request, _ in direct])
        if len(self._slot_writes) > MAX_SLOT_WRITES:  # fetched, never decoded here
            self._slot_writes.clear()
        for (i, request, slot), data in zip(direct, got):
            out[i] = (request, data)
            if data is not None:
                self._slot_writes[request] = slot

    def keep(self, request: Request, data: bytes | memoryview) -> None:
        """Write a chunk fetched for its SSD slot, whose bytes decoded, into that slot
        (nothing for a chunk that is not waiting for one)."""
        slot = self._slot_writes.pop(request, None) if self._slot_writes else None
        if slot is not None and self.slotted is not None:
            self.slotted.write(*slot, data)

    def forget(self, request: Request) -> None:
        """Write nothing for ``request`` (its bytes failed, or another tier keeps it)."""
        if self._slot_writes:
            self._slot_writes.pop(request, None)
