"""The RAM tier filled by the reads themselves (``ram_format="chunks"``).

Each shard of a time array is one slotted value in the RAM tier (:mod:`zstore.cache.slots`):
a slot per inner chunk, decoded (float int16 samples kept as the samples, half the
bytes), indexed at the shard's first touch with its whole size counted against the
budget.  A read serves every chunk of its windows that the tier holds from its map
(no lookup, no decode: the window copy widens it), and decodes the others from the SSD
tier or the origin as a read without a tier would; each chunk it decodes is written
into its slot as the window is copied out of it.  Nothing is fetched or decoded for
the tier alone and no read waits for a fill: the first epoch costs what the reads
decode plus the tmpfs writes, and its overlapping windows already find half their
chunks written (docs/benchmarks-notes.md, "A RAM tier filled by the reads
themselves").

A chunk this tier keeps is not written into the SSD tier's slots as well
(:mod:`zstore.read._ssd_slots`, a remote store read by ranges): the SSD tier holds what
this one does not.  Writing both, the first epoch on an NFS-like origin read at 0.79x
of no tiers, against 0.94x (1 rank; docs/benchmarks-notes.md, "The SSD tier filled by
the reads").

A chunk whose values are not all int16 samples, though the manifest says so, is not
written (it is decoded on every read; said once per array).  Admission and eviction
are the tier's, per shard: a full tier admits a shard that displaces resident ones
only when it is read clearly more often (:mod:`zstore.cache._space`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from zstore.cache.slots import slots_nbytes
from zstore.format import ArrayLayout
from zstore.origin import Request
from zstore.read._chunk_fills import ChunkFills
from zstore.read._ram_form import RamForm
from zstore.read._shard_pieces import Lazy, Pieces, Plan, in_shard
from zstore.read._slot_shards import SUFFIX, SlotShard, geometry


class ChunkShards(RamForm, ChunkFills):
    """Shards in the RAM tier as slots of decoded chunks, written by the reads."""

    suffix = SUFFIX
    decoded = True

    def __init__(self, *args: Any, **kwargs: Any):  # RamForm's
        super().__init__(*args, **kwargs)
        self._start_fills(self.source)

    def nbytes(self, layout: ArrayLayout, s: int) -> int:
        """Bytes shard ``s`` takes in the tier (what admission weighs)."""
        n, data_nbytes, _ = geometry(layout, s)
        return slots_nbytes(n, data_nbytes)

    def pieces(self, plan: Plan) -> Pieces:
        """Pieces covering every span of ``plan``: a shard whose chunks in the span are
        all in the tier is one piece, as a whole decoded shard is; otherwise each chunk
        the tier holds is a piece of its own, and the others are read and decoded as
        they are copied out, and written into their slots then.  Until the node's first
        reads are served (the reader's hold on its builds: ``zstore.read._builds``) the
        tier is only read: a fresh job's first batches cost what they cost with no tier
        (their chunks are written when they are read again).  Re-decoding them behind the
        reads took CPU from the first epoch's reads: ~100 chunks per rank."""
        fill = self.inline or not self.behind.held
        pieces: Pieces = {}
        need: list[tuple[ArrayLayout, int]] = []
        into: list[tuple[SlotShard | None, int, bool]] = []
        hits = hit_bytes = 0
        shards: dict[tuple[str, int], SlotShard | None] = {}
        seen: set[tuple[str, int]] = set()
        for _, layout, span in plan:
            per = layout.chunks_per_shard
            for s in range(span.start // layout.shard, (span.stop - 1) // layout.shard + 1):
                if (layout.path, s) in shards:
                    shard = shards[(layout.path, s)]
                else:
                    shard = shards[(layout.path, s)] = self._shard(layout, s, fill)
                part = in_shard(layout, s, span)
                ks = layout.chunks_for(part.start, part.stop)
                if shard is not None and shard.holds(ks.start - s * per, ks.stop - s * per):
                    if (layout.path, s) not in pieces:
                        pieces[(layout.path, s)] = (s * layout.shard, shard.array)
                        if fill:
                            self._complete_later(layout, s, shard)
                    hits += len(ks)
                    hit_bytes += len(ks) * shard.chunk_bytes
                    continue
                for k in ks:
                    at = (layout.path, -1 - k)
                    if at in seen:
                        continue
                    seen.add(at)
                    if shard is not None and shard.has(k - s * per):
                        pieces[at] = (k * layout.chunk, shard.chunk(k - s * per))
                        hits += 1
                        hit_bytes += shard.chunk_bytes
                        continue
                    need.append((layout, k))
                    into.append((shard, k - s * per, fill))
        stats = self.ram.stats
        if hits:
            stats.add("ram_hits", hits)
            stats.add("ram_hit_bytes", hit_bytes)
        if not need:
            return pieces
        stats.add("ram_misses", len(need))
        self.chunk_bytes += sum(layout.chunk_nbytes for layout, _ in need)
        raw = self.source.raw(need, ram=False)
        for (layout, k), (request, data), (shard, j, write) in zip(need, raw, into):
            lazy = Lazy(layout, partial(self._decode, layout, request, data, shard, j, write))
            if self.inline:
                lazy.decoded()  # written into its slot now
            pieces[(layout.path, -1 - k)] = (k * layout.chunk, lazy)
        return pieces

    def _shard(self, layout: ArrayLayout, s: int, fill: bool) -> SlotShard | None:
        """This process's map of shard ``s``, indexed empty now (``fill``) if the tier
        lacks it and admits it; None where it does not (its chunks are read, not
        written)."""
        key = self.key(layout, s)
        self.ram.touch(key)  # an access, for admission
        shard: SlotShard | None = self.values.slotted(
            key,
            partial(SlotShard, layout, s),
            reserve=partial(self.nbytes, layout, s) if fill else None,
        )
        return shard

    def _decode(
        self,
        layout: ArrayLayout,
        request: Request | None,
        data: Any,
        shard: SlotShard | None,
        j: int,
        write: bool,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Chunk ``j`` of its shard: from its slot when it was written since the read
        was planned (another window of the batch, another process), else decoded and
        (``write``) written into its slot."""
        if shard is not None and shard.has(j):
            self.ram.stats.add("ram_hits")
            return shard.chunk(j)
        # a chunk this tier keeps is not written to the SSD tier too (see the module)
        if shard is None or not write:
            return self.source.decode(layout, request, data, out)
        chunk = self.source.decode(layout, request, data, out, keep=False)
        self._kept(self.source, layout, shard, j, chunk, request, data)
        return chunk
