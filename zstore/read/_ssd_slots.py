"""The SSD tier filled by the reads: a shard object kept as one slotted value, a slot per
inner chunk at the chunk's own place in the object and one more for the shard index
after them (``fetch="slots"``, what ``"auto"`` picks for a remote store with an SSD
tier unless it fetches whole shards: see :mod:`zstore.read._fetch_mode`).

A read takes the index and each chunk of its windows that the SSD tier holds from its
map, and fetches the others from the origin by their ranges, as a read with no tier
does, past the tiers' lookups and locks; each one it fetches is written into its slot
with ``pwrite`` (:mod:`zstore.cache.slots`: a presence byte and a crc32c per slot) once
its bytes decode, in the thread that decodes it (:mod:`zstore.read._slot_reads`),
unless the RAM tier keeps the chunk.  Nothing is fetched for the tier alone and no
read waits for a write; a shard costs one file and one index row, at the first write
into it, its whole size counted against the budget and its unwritten slots holes of
a sparse file.  A later job reads the shard's index from the value too: nothing but
the store's root from the origin.  A fresh job's first reads (the reader's hold on its
builds) write nothing: writing them took its first batch from 1.12x to 1.31x of no
tiers' (NFS-like, 1 rank).  No node lock is taken: two processes that miss a
chunk at once both fetch it (``fetch="range"`` keeps each chunk under the node's
lock, one SSD value each).

Kept as one value per chunk (and the index as one more), a window's ~20 chunks cost a
file and an index row apiece in the first epoch (NFS-like origin, 1 rank: 0.33x of
no tiers); fetched whole, each shard's first touch waited for 7 MB and wrote it
(0.72-0.80x); filled by the reads, 0.94x with 1 rank and with 4
(docs/benchmarks-notes.md, "The SSD tier filled by the reads").
"""

from __future__ import annotations

import threading
from functools import partial

import numpy as np
from crc32c import crc32c

from zstore.cache import TieredCache
from zstore.cache.slots import Slots, data_nbytes_of, slots_nbytes
from zstore.errors import IntegrityError
from zstore.format import EMPTY, ArrayLayout, decode_index
from zstore.read._builds import BehindBuilds
from zstore.read._maps import MappedValues

#: the SSD tier key's suffix of a shard object in this form
SUFFIX = "#F"
#: shard indexes fetched from the origin a process holds for values it has not indexed
MAX_FETCHED = 4096


def chunks_end(index: np.ndarray) -> int:
    """The end of a shard object's last chunk (0 when none is written)."""
    written = index[:, 0] != EMPTY
    if not written.any():
        return 0
    return int((index[written, 0] + index[written, 1]).max())


class EncodedShard:
    """A mapped slotted value of one shard object: slot ``j < chunks_per_shard`` holds
    chunk ``j``'s encoded bytes at their place in the object, the last slot the shard
    index after them.  ``index`` is set once known (read from the value or the
    origin)."""

    def __init__(self, payload: memoryview, layout: ArrayLayout):
        n = layout.chunks_per_shard + 1
        self.layout = layout
        self.slots = Slots(payload, n, data_nbytes_of(n, len(payload)))
        self.index: np.ndarray | None = None
        #: where the shard index lies in the data (after the chunks)
        self._index_at = len(self.slots.data) - layout.index_bytes
        if self._index_at < 0:
            raise ValueError("a slotted shard value too small for its index")

    def read_index(self, where: str) -> np.ndarray | None:
        """The shard index from its slot (None when it is not written, or fails)."""
        raw = self.index_bytes()
        if raw is None:
            return None
        try:
            index = decode_index(self.layout, raw, where)
        except IntegrityError:
            return None
        if chunks_end(index) > self._index_at:
            return None
        self.index = index
        return index

    def index_bytes(self) -> memoryview | None:
        """The shard index's bytes as the origin holds them, from its slot (None when
        it is not written, or fails its check)."""
        nbytes = self.layout.index_bytes
        if not self.slots.has(self.layout.chunks_per_shard, [(self._index_at, nbytes)]):
            return None
        return self.slots.data[self._index_at : self._index_at + nbytes]

    def write_index(self, data: bytes | memoryview) -> bool:
        """Write the shard index's slot (its bytes as the origin holds them)."""
        view = memoryview(data).cast("B")
        if len(view) != self.layout.index_bytes:
            return False
        slot = self.layout.chunks_per_shard
        return self.slots.write(slot, [(self._index_at, view)], crc32c(view))

    def _range(self, j: int) -> tuple[int, int] | None:
        if self.index is None:
            return None
        offset, nbytes = self.index[j]
        if offset == EMPTY or int(offset) + int(nbytes) > self._index_at:
            return None
        return int(offset), int(nbytes)

    def has(self, j: int) -> bool:
        """Whether chunk ``j`` is in the tier, whole and checked."""
        span = self._range(j)
        return span is not None and self.slots.has(j, [span])

    def chunk(self, j: int) -> memoryview:
        """Chunk ``j``'s bytes in the map (check :meth:`has` first)."""
        offset, nbytes = self._range(j)  # type: ignore[misc]
        return self.slots.data[offset : offset + nbytes]

    def write(self, j: int, data: bytes | memoryview) -> bool:
        """Write chunk ``j`` (its encoded bytes as the origin holds them)."""
        span = self._range(j)
        view = memoryview(data).cast("B")
        if span is None or len(view) != span[1]:
            return False
        return self.slots.write(j, [(span[0], view)], crc32c(view))


class SlottedShards:
    """The SSD tier's slotted shard objects of one store, as this process maps them."""

    def __init__(
        self, url: str, tiers: TieredCache, values: MappedValues, hold: BehindBuilds | None
    ):
        assert tiers.ssd is not None
        self.url, self.tiers, self.ssd, self.values = url, tiers, tiers.ssd, values
        #: held until the node's first reads are served: nothing is written before
        self.hold = hold
        #: shard indexes this process fetched from the origin, for the slot of the
        #: value it indexes next for them
        self._fetched: dict[str, bytes] = {}
        self._fetched_lock = threading.Lock()  # the reading thread adds, copy threads take

    def mapped(self, obj: str, layout: ArrayLayout) -> EncodedShard | None:
        """This process's map of shard object ``obj``; None when the tier lacks it."""
        key = self.tiers.key(f"{obj}{SUFFIX}")
        shard: EncodedShard | None = self.values.slotted(
            key, partial(EncodedShard, layout=layout), lock=self.values.lock
        )
        return shard

    def indexes(self, todo: dict[str, ArrayLayout]) -> dict[str, np.ndarray]:
        """The shard indexes of ``todo`` (objects) that the tier holds."""
        found: dict[str, np.ndarray] = {}
        for obj, layout in todo.items():
            shard = self.mapped(obj, layout)
            if shard is None:
                continue
            index = shard.index if shard.index is not None else shard.read_index(self.where(obj))
            if index is not None:
                found[obj] = index
        return found

    def fetched(self, obj: str, data: bytes | memoryview) -> None:
        """Hold the bytes of ``obj``'s shard index, fetched from the origin, for the
        value :meth:`shard` indexes for it."""
        with self._fetched_lock:
            self._fetched[obj] = bytes(data)
            if len(self._fetched) > MAX_FETCHED:
                self._fetched.pop(next(iter(self._fetched)))

    def held(self, obj: str, layout: ArrayLayout, index: np.ndarray) -> EncodedShard | None:
        """This process's map of shard object ``obj`` (``index``: its shard index) when
        the tier holds it (not indexed here: see :meth:`shard`)."""
        self.ssd.touch(self.tiers.key(f"{obj}{SUFFIX}"))  # an access, for admission
        shard = self.mapped(obj, layout)
        if shard is not None and shard.index is None:
            shard.index = index
        return shard

    def shard(self, obj: str, layout: ArrayLayout, index: np.ndarray) -> EncodedShard | None:
        """The value of shard object ``obj`` (``index``: its shard index) for a chunk
        to write, indexed empty now if the tier lacks it and admits it; None where it
        does not (the chunk is not kept)."""
        shard: EncodedShard | None = self.values.slotted(
            self.tiers.key(f"{obj}{SUFFIX}"),
            partial(EncodedShard, layout=layout),
            reserve=partial(_value_nbytes, layout, index),
            lock=self.values.lock,
        )
        if shard is None:
            return None
        if shard.index is None:
            shard.index = index
        with self._fetched_lock:
            raw = self._fetched.pop(obj, None)
        if raw is not None and not shard.slots.present[layout.chunks_per_shard]:
            shard.write_index(raw)
        return shard

    def write(
        self, obj: str, layout: ArrayLayout, index: np.ndarray, j: int, data: bytes | memoryview
    ) -> None:
        """Write chunk ``j`` of shard object ``obj`` (fetched, and decoded fine) into
        its slot, indexing the shard's value first where the tier lacks it; nothing
        while the node's first reads are held (their chunks are written when they are
        read again)."""
        if self.hold is not None and self.hold.held:
            return
        shard = self.shard(obj, layout, index)
        if shard is not None and shard.write(j, data):
            self.tiers.stats.add("ssd_fills")
            self.tiers.stats.add("ssd_fill_bytes", len(data))

    def drop(self, obj: str) -> None:
        """Remove shard object ``obj``'s slotted value (``zstore cache warm`` keeps the
        object whole in its place)."""
        self.values.remove(self.tiers.key(f"{obj}{SUFFIX}"))

    def where(self, obj: str) -> str:
        return f"{self.url}: {obj} (shard index in the SSD tier)"


def _value_nbytes(layout: ArrayLayout, index: np.ndarray) -> int:
    """The payload bytes of a shard object's slotted value (0 when no chunk of it is
    written: no value)."""
    end = chunks_end(index)
    return slots_nbytes(layout.chunks_per_shard + 1, end + layout.index_bytes) if end else 0
