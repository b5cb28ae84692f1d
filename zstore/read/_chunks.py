"""Chunk bytes for the reader: shard indexes, byte ranges through the tiers, origin batches.

:class:`ChunkSource` turns (array, chunk) pairs into decoded chunks.  Everything a
call needs that the tiers miss is fetched from the origin in one concurrent
batch; with ``fetch="shard"`` a whole shard is read on first touch and kept whole in
the SSD tier (:mod:`zstore.read._ssd_shards`), or, without one, all its chunks go into the
RAM tier.  Chunks of a shard the SSD tier holds whole are sliced from its map.  A
remote store read by ranges keeps its chunks in the SSD tier's slots instead
(:mod:`zstore.read._slot_reads`).  The fetching itself (the tiers, then the origin) is
:mod:`zstore.read._origin_fetch`.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from zstore.cache import TieredCache
from zstore.errors import IntegrityError, MissingDataError
from zstore.format import EMPTY, ArrayLayout, decode_chunk, fill_chunk
from zstore.origin import Origin, Request, describe
from zstore.read._builds import BehindBuilds
from zstore.read._held_chunks import HeldChunks
from zstore.read._origin_fetch import OriginFetch, range_key
from zstore.read._replaced import StoreCheck
from zstore.read._shard_indexes import ShardIndexes
from zstore.read._slot_reads import SlotReads
from zstore.read._ssd_shards import Held, WholeShards
from zstore.read._ssd_slots import SlottedShards
from zstore.read._whole_fetch import Pending, WholeFetch, finish


class ChunkSource(ShardIndexes, OriginFetch, HeldChunks, SlotReads):
    """Fetch and decode inner chunks of one store for one process.

    ``complete``: the store's converter wrote every chunk (the manifest says so), so a
    missing object or an empty shard-index entry is lost data and raises
    :class:`MissingDataError`; otherwise (stores of other writers) it reads as the
    fill value, as in zarr.
    """

    def __init__(
        self,
        url: str,
        origin: Origin,
        tiers: TieredCache | None,
        fetch: str,
        complete: bool = False,
        behind: BehindBuilds | None = None,
        check: StoreCheck | None = None,
    ):
        self.url, self.origin, self.tiers, self.fetch = url, origin, tiers, fetch
        self.complete = complete
        #: the store's root checked in every origin round: not another store's values
        self.check = check
        self._indexes: OrderedDict[str, np.ndarray] = OrderedDict()
        self.whole = (
            WholeShards(url, tiers, behind) if tiers is not None and tiers.ssd is not None else None
        )
        self.whole_fetch = (
            WholeFetch(self.whole, self._read, self._missing, complete)
            if self.whole is not None
            else None
        )
        # the SSD tier filled by the reads' ranges (fetch="slots")
        self._start_slots(
            SlottedShards(url, tiers, self.whole.values, behind)  # type: ignore[arg-type]
            if self.whole is not None and fetch == "slots"
            else None
        )

    def for_thread(self) -> ChunkSource:
        """A source of the same store, with its own shard indexes, for another thread
        (a source is used by one thread at a time)."""
        return ChunkSource(
            self.url, self.origin, self.tiers, self.fetch, self.complete, check=self.check
        )

    def _missing(self, obj: str, what: str) -> MissingDataError:
        """The error for ``obj`` missing, once the store's root says it is still the
        store opened: a store removed or replaced under the job (``--overwrite``) is
        :class:`StoreReplacedError`, raised here, not a damaged store."""
        if self.check is not None:
            self.check.now(self.origin)
        return missing_error(self.url, obj, what)

    def raw(
        self, need: list[tuple[ArrayLayout, int]], *, ram: bool
    ) -> list[tuple[Request | None, bytes | memoryview | None]]:
        """The encoded bytes of (layout, chunk number) pairs and the origin request each
        came from; (None, None) for a chunk never written (stores of other writers).  A
        chunk ``need`` names twice (two windows of one batch over the same part of an
        item) is fetched once: it was fetched once per window, each a request of its own
        to the origin (docs/benchmarks-notes.md, "A chunk named twice in one batch")."""
        at: dict[tuple[str, int], int] = {}
        unique: list[tuple[ArrayLayout, int]] = []
        for layout, k in need:
            if at.setdefault((layout.path, k), len(unique)) == len(unique):
                unique.append((layout, k))
        if len(unique) == len(need):
            return self._raw(need, ram)
        got = self._raw(unique, ram)
        return [got[at[(layout.path, k)]] for layout, k in need]

    def _raw(
        self, need: list[tuple[ArrayLayout, int]], ram: bool
    ) -> list[tuple[Request | None, bytes | memoryview | None]]:
        """:meth:`raw` of chunks ``need`` names once each."""
        held, around, pending = (
            self.whole_fetch.find(need, fetch=self.fetch == "shard")
            if self.whole_fetch is not None
            else ({}, set(), None)
        )
        try:  # the ranges around shards fetched whole elsewhere, while this one's run
            out, later = self._ranges(need, held, around, pending, ram)
        except BaseException:
            finish(pending, failing=True)
            raise
        fetched = finish(pending)
        for i, obj, n in later:
            got = self._held_chunk(obj, n, fetched[obj])
            if got is not None:
                out[i] = got
        if self.complete:
            for i, (layout, k) in enumerate(need):
                if out[i][1] is None:
                    raise self._missing(layout.object_key(k // layout.chunks_per_shard), "chunk")
        return out

    def _ranges(
        self,
        need: list[tuple[ArrayLayout, int]],
        held: dict[str, Held],
        around: set[str],
        pending: Pending | None,
        ram: bool,
    ) -> tuple[list[tuple[Request | None, bytes | memoryview | None]], list[tuple[int, str, int]]]:
        """The bytes of ``need`` from shards ``held`` whole and, through the tiers and the
        origin, by ranges; and (slot, object, chunk in shard) of those in shards
        ``pending`` fetches whole, to take from it once it is done."""
        coming = pending.objs if pending is not None else set()
        indexes = self.index(
            [
                (layout, k // layout.chunks_per_shard)
                for layout, k in need
                if layout.sharded
                and (obj := layout.object_key(k // layout.chunks_per_shard)) not in held
                and obj not in coming
            ],
            ranges=around,
        )
        keys: list[str] = []
        requests: list[Request] = []
        slots: list[int] = []
        later: list[tuple[int, str, int]] = []
        layouts: dict[str, ArrayLayout] = {}
        out: list[tuple[Request | None, bytes | memoryview | None]] = [(None, None)] * len(need)
        for i, (layout, k) in enumerate(need):
            obj = layout.object_key(k // layout.chunks_per_shard)
            if not layout.sharded:  # one object per chunk
                keys.append(obj)
                requests.append((obj, None, None))
                slots.append(i)
                continue
            if obj in coming:
                later.append((i, obj, k % layout.chunks_per_shard))
                continue
            whole = held.get(obj)
            if whole is not None:
                got = self._held_chunk(obj, k % layout.chunks_per_shard, whole)
                if got is not None:
                    out[i] = got
                continue
            offset, nbytes = indexes[obj][k % layout.chunks_per_shard]
            if offset == EMPTY and self.complete:
                raise self._missing(obj, f"chunk {k % layout.chunks_per_shard} of shard")
            if offset == EMPTY:  # never written: the fill value
                continue
            start, stop = int(offset), int(offset + nbytes)
            if self.slotted is not None:
                j = k % layout.chunks_per_shard
                self._slot_chunk(out, i, (obj, start, stop), layout, indexes[obj], j)
                continue
            layouts[obj] = layout
            keys.append(range_key(obj, start, stop))
            requests.append((obj, start, stop))
            slots.append(i)
        values = (
            self.fetch_many(keys, requests, ram=ram, layouts=layouts, ranges=around, reused=True)
            if keys
            else []
        )
        for i, request, data in zip(slots, requests, values):
            out[i] = (request, data)
        if self.slotted is not None:
            self._slotted_ranges(out)
        return out, later

    def decode(
        self,
        layout: ArrayLayout,
        request: Request | None,
        data: bytes | memoryview | None,
        out: np.ndarray | None = None,
        *,
        keep: bool = True,
    ) -> np.ndarray:
        """Decode one chunk's bytes (into ``out`` where it can, see ``decode_chunk``); a
        chunk never written is the fill value; bytes that fail their check are fetched
        once more from the origin, past the tiers.  Bytes fetched for the SSD tier's
        slots are written there once they decode; with ``keep`` False the caller says
        where they go after: :meth:`keep` (into the slot) or :meth:`forget` (the RAM
        tier keeps the chunk)."""
        if data is None or request is None:
            return fill_chunk(layout)
        where = f"{self.url}: {describe(*request)}"
        try:
            chunk = decode_chunk(layout, data, where, out)
        except IntegrityError:  # once more, past the tiers (the root checked beside it)
            self.forget(request)
            again = self._read([request])[0]
            if again is None:
                raise self._missing(request[0], "chunk") from None
            return decode_chunk(layout, again, where, out)
        if keep:
            self.keep(request, data)
        return chunk


def chunk_array(key: str) -> str:
    """The array path of a chunk key (``<item>/<array>/c/0/3`` or ``.../c``), or ""."""
    return key[:-2] if key.endswith("/c") else key.rpartition("/c/")[0]


def missing_error(url: str, key: str, what: str) -> MissingDataError:
    """The error for an object that a complete store must hold but does not."""
    item, _, array = chunk_array(key).rpartition("/")
    return MissingDataError(
        f"{url}: {what} '{key}' (item '{item}', array '{array}') is missing, but this "
        "store's converter wrote every chunk: the store is damaged or was copied "
        "incompletely. Restore the object from a good copy, or reconvert the source "
        "(zstore convert ... --overwrite); nothing was read as zeros"
    )
