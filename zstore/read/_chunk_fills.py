"""What the form the reads fill (:mod:`zstore.read._chunk_shards`) writes: a decoded
chunk into its slot (narrowed to int16 samples where the array holds them), and, behind
the reads, the rest of a shard mostly read."""

from __future__ import annotations

import logging
import math
import threading
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from zstore.cache import TieredCache
from zstore.format import ArrayLayout
from zstore.origin import Request
from zstore.read._builds import FORK_GATE, BehindBuilds
from zstore.read._chunks import ChunkSource
from zstore.read._maps import MappedValues
from zstore.read._shard_pieces import Lazy
from zstore.read._slot_shards import SlotShard
from zstore.read.streamcopy import narrow

log = logging.getLogger("zstore")

#: A shard with at least this share of its chunks in the tier has the rest decoded and
#: written behind the reads, once per process: reads alone leave a few chunks of each
#: shard out for epochs (~2% of an epoch's chunks still decoded in its fourth epoch,
#: which read at ~0.6x of whole decoded shards), while completing a shard early in the
#: first epoch would put that work in front of its reads (docs/benchmarks-notes.md).
COMPLETE_AT = 0.75


class ChunkFills:
    """The writes of :class:`zstore.read._chunk_shards.ChunkShards`."""

    if TYPE_CHECKING:
        url: str
        tiers: TieredCache
        ram: Any
        values: MappedValues
        behind: BehindBuilds

        def key(self, layout: ArrayLayout, s: int) -> str: ...

        def _shard(self, layout: ArrayLayout, s: int, fill: bool) -> SlotShard | None: ...

    def _start_fills(self, source: ChunkSource) -> None:
        self._not_samples: set[str] = set()  # array paths said to hold other values
        self._scratch = threading.local()
        #: the builder thread's own chunk source (a source is used by one thread)
        self.builder_source = source.for_thread()
        self._completing: set[str] = set()  # shard keys given to the builder thread

    def _complete_later(self, layout: ArrayLayout, s: int, shard: SlotShard) -> None:
        """Queue the rest of shard ``s`` behind the reads once COMPLETE_AT of its chunks
        are in the tier (once per process; called when a read found every chunk it wanted
        of the shard in the tier: in the first epoch, while the reads still decode most
        of their chunks, this work would take their CPU)."""
        if shard.complete:
            return
        written = int(shard.slots.present.sum())
        if written == shard.slots.n:
            shard.complete = True
            return
        key = self.key(layout, s)
        if written < COMPLETE_AT * shard.slots.n or key in self._completing:
            return
        if self.behind.submit(key, partial(self._complete, layout, s, shard)):
            self._completing.add(key)

    def _complete(self, layout: ArrayLayout, s: int, shard: SlotShard, done: Any) -> None:
        """Decode and write the chunks of shard ``s`` not in the tier (the builder
        thread: :mod:`zstore.read._builds`), under the node's lock for the shard: a
        shard another process is completing is left to it."""
        locks = self.tiers.decode_locks
        held = locks.acquire([self.key(layout, s)], wait=False) if locks is not None else []
        if held is None:
            return
        try:
            first = s * layout.chunks_per_shard
            missing = [j for j in range(shard.slots.n) if not shard.has(j)]
            need = [(layout, first + j) for j in missing]
            with FORK_GATE.held():  # its fetch (SQLite) and decoding (blosc)
                raw = self.builder_source.raw(need, ram=False)
                for j, (request, data) in zip(missing, raw):
                    if shard.has(j):  # written by a read meanwhile
                        continue
                    source = self.builder_source
                    decode = partial(source.decode, layout, request, data, keep=False)
                    chunk = Lazy(layout, decode).decoded()
                    self._kept(source, layout, shard, j, chunk, request, data)
                del raw
        finally:
            if locks is not None:
                locks.release(held)

    def _kept(
        self,
        source: ChunkSource,
        layout: ArrayLayout,
        shard: SlotShard,
        j: int,
        chunk: np.ndarray,
        request: Request | None,
        data: Any,
    ) -> None:
        """Write decoded chunk ``j`` into its slot, and its bytes (where they were
        fetched for the SSD tier's slots) into the SSD tier only when this tier does
        not keep it: kept in both, the first epoch on an NFS-like origin read at 0.79x
        of no tiers against 0.94x, and the completions' SSD writes (a value indexed in
        the builder thread for each shard) made 4 ranks' later epochs slower with the
        SSD tier than without it (docs/benchmarks-notes.md)."""
        written = self._write(layout, shard, j, chunk)
        if request is None:
            return
        if written:
            source.forget(request)
        else:  # not in this tier after all: in the SSD tier
            source.keep(request, data)

    def _write(self, layout: ArrayLayout, shard: SlotShard, j: int, chunk: np.ndarray) -> bool:
        """Write a decoded chunk into slot ``j``, in the reading thread: narrowed to its
        int16 samples where the array holds them; left out where one of its values is
        not a sample (False then, and when the write fails).  (A thread writing behind
        the reads was slower: the loader's copy threads leave no core idle;
        docs/benchmarks-notes.md.)"""
        if layout.ram_dtype == chunk.dtype:
            values = np.ascontiguousarray(chunk)
        else:
            nbytes = math.prod(layout.chunk_shape) * layout.ram_dtype.itemsize
            scratch = self._scratch_bytes(nbytes)
            values = scratch.view(layout.ram_dtype).reshape(layout.chunk_shape)
            if not narrow(values, chunk):
                self._said_not_samples(layout)
                return False
        if not shard.write(j, values):
            return False
        self.ram.stats.add("ram_fills")
        self.ram.stats.add("ram_fill_bytes", values.nbytes)
        return True

    def _scratch_bytes(self, nbytes: int) -> np.ndarray:
        """This thread's scratch of ``nbytes`` (a chunk written in the reading thread)."""
        buf = getattr(self._scratch, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._scratch.buf = np.empty(nbytes, dtype=np.uint8)
        return buf[:nbytes]

    def _said_not_samples(self, layout: ArrayLayout) -> None:
        if layout.path not in self._not_samples:
            self._not_samples.add(layout.path)
            log.warning(
                "zstore: %s: '%s' holds values that are not int16 samples, though the "
                "store's manifest says it does; its chunks that hold them are not kept "
                "in the RAM tier and are decoded on every read (the values read are the "
                "stored ones either way)",
                self.url,
                layout.path,
            )
