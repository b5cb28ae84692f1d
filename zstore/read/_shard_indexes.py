"""Shard indexes for :class:`zstore.read._chunks.ChunkSource`: those this process holds,
those the SSD tier holds (a whole shard's, a slotted shard's), the others fetched
together, through the tiers, in one origin round."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import numpy as np

from zstore.errors import IntegrityError
from zstore.format import EMPTY, ArrayLayout, decode_index
from zstore.origin import Origin, Request
from zstore.read._origin_fetch import index_key

if TYPE_CHECKING:
    from zstore.errors import MissingDataError
    from zstore.read._replaced import StoreCheck
    from zstore.read._ssd_shards import WholeShards
    from zstore.read._ssd_slots import SlottedShards

MAX_INDEXES = 4096  # shard indexes (~1 KiB each) a process keeps


class ShardIndexes:
    """The shard indexes a source reads its chunks by (see the module)."""

    if TYPE_CHECKING:
        url: str
        origin: Origin
        complete: bool
        check: StoreCheck | None
        whole: WholeShards | None
        slotted: SlottedShards | None

        def _missing(self, obj: str, what: str) -> MissingDataError: ...

        def _read(self, requests: list[Request]) -> list[bytes | memoryview | None]: ...

        #: :meth:`zstore.read._origin_fetch.OriginFetch.fetch_many`
        fetch_many: Callable[..., list[bytes | memoryview | None]]

    _indexes: OrderedDict[str, np.ndarray]

    def known_indexes(self, objs: list[str]) -> dict[str, np.ndarray]:
        """The shard indexes of ``objs`` this source already holds."""
        return {obj: self._indexes[obj] for obj in objs if obj in self._indexes}

    def remember_indexes(self, indexes: dict[str, np.ndarray]) -> None:
        """Hold ``indexes`` (another source's, e.g. the reader's for a fill behind it)."""
        for obj, index in indexes.items():
            self._indexes[obj] = index
            if len(self._indexes) > MAX_INDEXES:
                self._indexes.popitem(last=False)

    def index(
        self,
        shards: list[tuple[ArrayLayout, int]],
        *,
        ranges: Collection[str] = (),
        wait: bool = True,
    ) -> dict[str, np.ndarray]:
        """Shard indexes of the given (layout, shard) pairs, fetched together (``ranges``
        and ``wait``: see :meth:`fetch_many`)."""
        found: dict[str, np.ndarray] = {}
        todo: dict[str, ArrayLayout] = {}
        for layout, shard in shards:
            obj = layout.object_key(shard)
            if obj in self._indexes:
                found[obj] = self._indexes[obj]
            else:
                todo[obj] = layout
        if todo and self.whole is not None:  # a shard the SSD tier holds whole has its index
            held = self.whole.held_many({obj: (layout, []) for obj, layout in todo.items()})
            for obj, whole in held.items():
                found[obj] = whole.index
                del todo[obj]
        if todo and self.slotted is not None:  # so does one in the SSD tier's slots
            for obj, index in self.slotted.indexes(todo).items():
                found[obj] = self._indexes[obj] = index
                del todo[obj]
        if todo:
            keys = [index_key(obj, layout) for obj, layout in todo.items()]
            requests: list[Request] = [
                (obj, -layout.index_bytes, None) for obj, layout in todo.items()
            ]
            # A store on a local disk reads an index from the page cache (~1 KiB); in the
            # RAM tier it cost a lookup and a write transaction on each shard's first
            # touch, which 4 ranks took in turn (their first batch came 13-23 ms sooner
            # without it; docs/benchmarks-notes.md).
            ram = not self.origin.local_disk
            if self.slotted is not None:  # kept in the slotted shards' values
                values = self._read(requests)
                for obj, data in zip(todo, values):
                    if data is not None:
                        self.slotted.fetched(obj, data)
            else:
                values = self.fetch_many(
                    keys, requests, ram=ram, layouts=todo, ranges=ranges, wait=wait
                )
            for (obj, layout), data in zip(todo.items(), values):
                if data is None and self.complete:
                    raise self._missing(obj, "shard")
                if data is None:  # a shard the store never wrote: all fill value
                    index = np.full((layout.chunks_per_shard, 2), EMPTY, dtype=np.uint64)
                else:
                    index = self._index(layout, data, obj)
                found[obj] = self._indexes[obj] = index
                if len(self._indexes) > MAX_INDEXES:
                    self._indexes.popitem(last=False)
        return found

    def _index(self, layout: ArrayLayout, data: bytes | memoryview, obj: str) -> np.ndarray:
        """A shard index decoded; one cut short or damaged is checked against the
        store's root first (an index round reads no root beside it): a shard being
        rewritten by a conversion with ``--overwrite`` is :class:`StoreReplacedError`."""
        try:
            return decode_index(layout, data, f"{self.url}: {obj} (shard index)")
        except IntegrityError:
            if self.check is not None:
                self.check.now(self.origin)
            raise
