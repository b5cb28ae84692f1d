"""Chunks of shard objects this process holds whole in memory (fetched whole, their
SSD write or a RAM fill of them still queued): the part of
:class:`zstore.read._chunks.ChunkSource` that slices chunks out of them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from zstore.format import ArrayLayout
from zstore.origin import Request
from zstore.read._ssd_slots import SlottedShards

if TYPE_CHECKING:
    from zstore.errors import MissingDataError
    from zstore.read._ssd_shards import Held, WholeShards
    from zstore.read._whole_fetch import WholeFetch


class HeldChunks:
    """Chunks sliced from shard objects held whole (see the module)."""

    if TYPE_CHECKING:
        complete: bool
        url: str
        slotted: SlottedShards | None
        whole: WholeShards | None
        whole_fetch: WholeFetch | None

        def _missing(self, obj: str, what: str) -> MissingDataError: ...

    def _held_chunk(
        self, obj: str, n: int, whole: Held
    ) -> tuple[Request, bytes | memoryview] | None:
        """Chunk ``n`` of shard object ``obj``, at hand ``whole``, as :meth:`raw` gives
        it; None when it was never written (the fill value; an error for a store that
        must be complete)."""
        span = whole.chunk(n)
        if span is None and self.complete:
            raise self._missing(obj, f"chunk {n} of shard")
        if span is None:
            return None
        return (obj, *span), whole.payload[span[0] : span[1]]

    def in_memory(
        self, need: Iterable[tuple[ArrayLayout, int]]
    ) -> dict[tuple[str, int], tuple[Request, bytes | memoryview]]:
        """The chunks of ``need`` whose shard object is in this process's memory now
        (fetched whole, its SSD write or a RAM fill of it still queued), by (array path,
        chunk number).
        ``need`` is not looked at when this source fetches no shard whole."""
        out: dict[tuple[str, int], tuple[Request, bytes | memoryview]] = {}
        if self.whole is None:
            return out
        objects: dict[str, Held | None] = {}  # one lookup per shard object
        for layout, k in need:
            obj = layout.object_key(k // layout.chunks_per_shard)
            if obj not in objects:
                objects[obj] = self.whole.in_memory(obj)
            whole = objects[obj]
            if whole is not None:
                got = self._held_chunk(obj, k % layout.chunks_per_shard, whole)
                if got is not None:
                    out[(layout.path, k)] = got
        return out

    def keep_in_memory(self, objs: Iterable[str]) -> list[str]:
        """Keep those shard objects of ``objs`` this process holds in memory (see
        :meth:`in_memory`) there, for this process's reads too, until
        :meth:`let_go`; the ones kept."""
        return self.whole.keep(objs) if self.whole is not None else []

    def let_go(self, objs: list[str]) -> None:
        """Undo :meth:`keep_in_memory`."""
        if self.whole is not None and objs:
            self.whole.let_go(objs)

    def keep_whole(self, layout: ArrayLayout) -> None:
        """Put every shard of ``layout`` whole into the SSD tier (``zstore cache warm``),
        one at a time; shards it holds already are left alone, and those it holds as
        slots (a job's reads by ranges) are made whole from them."""
        if self.whole_fetch is None or self.whole is None:
            return
        slotted = self.slotted  # the slotted values of another fetch mode's job too
        if slotted is None:
            slotted = SlottedShards(self.url, self.whole.tiers, self.whole.values, None)
        self.whole_fetch.keep(layout, slotted)
