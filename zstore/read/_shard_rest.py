"""The fills behind the reads once they are queued (:mod:`zstore.read._shard_fills`
queues them): :class:`ShardRest` finds a queued shard's other chunks, fetches them
behind the reads at once from a remote origin read by ranges (within the at-hand
bytes), and in the thread behind the reads builds each shard into the RAM tier and
releases the node's lock its reader took."""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import TYPE_CHECKING, Any

import numpy as np

from zstore.format import EMPTY, ArrayLayout, Span
from zstore.read._builds import FORK_GATE, ByteBudget
from zstore.read._fill_chunks import Chunk, FillChunks, RestFetch
from zstore.read._shard_builds import ShardBuilds
from zstore.read._shard_pieces import REUSE, release_free_memory


class ShardRest(ShardBuilds):
    """The queued fills' other chunks and builds, for
    :class:`zstore.read._shard_fills.ShardFills`."""

    if TYPE_CHECKING:
        at_hand: ByteBudget
        fill_chunks: FillChunks

    def _rest_of(
        self,
        todo: list[tuple[ArrayLayout, int, Span, str]],
        have: Container[tuple[str, int]],
        indexes: dict[str, np.ndarray],
    ) -> tuple[list[Chunk], int]:
        """The chunks of ``todo``'s shards not in ``have``, to fetch behind the reads now
        (:mod:`zstore.read._fill_chunks`), and their bytes by the shard ``indexes``
        (decoded bytes where a shard's is not there; none for a chunk never written,
        which is not fetched).  None while the builds are held (the node's first
        batches are read with nothing beside them), nor where the store is local (the
        fill's reads are page-cache copies) or read by whole shard objects."""
        if (
            not todo
            or self.behind.held
            or self.source.fetch == "shard"
            or not self.source.origin.remote
        ):
            return [], 0
        rest: list[Chunk] = []
        nbytes = 0
        for layout, s, _, _ in todo:
            index = indexes.get(layout.object_key(s))
            for _, k in self._others(self._shard_chunks(layout, s), have):
                rest.append((layout, k))
                if index is None:
                    nbytes += layout.chunk_nbytes
                elif (entry := index[k % layout.chunks_per_shard])[0] != EMPTY:
                    nbytes += int(entry[1])
        return rest, nbytes

    @staticmethod
    def _others(chunks: list[Chunk], have: Container[tuple[str, int]]) -> list[Chunk]:
        """The chunks of ``chunks`` not in ``have``."""
        return [(la, k) for la, k in chunks if (la.path, k) not in have]

    def _fetch_rest(
        self, rest: list[Chunk], nbytes: int, indexes: dict[str, np.ndarray], later: RestFetch
    ) -> None:
        """Fetch a queued fill's other chunks ``rest`` (``nbytes``, :meth:`_rest_of`)
        behind the reads now, within the at-hand bytes, which sets ``later`` done;
        else ``later`` is done at once and the build fetches them itself."""
        if rest and self.at_hand.take(nbytes):
            self.fill_chunks.fetch(rest, indexes, nbytes, later)
        else:
            later.done.set()

    def _finish_builds(
        self,
        todo: list[tuple[ArrayLayout, int, Span, str]],
        have: dict[tuple[str, int], tuple[Any, Any]],
        locks: dict[str, list[int]],
        indexes: dict[str, np.ndarray],
        at_hand: tuple[int, list[str]],
        later: RestFetch,
        done: Callable[[str], None],
    ) -> None:
        """In the thread behind the reads: shard by shard, fetch its other chunks (those
        ``later`` did not fetch), build it into the tier, release the node's lock its
        reader took, mark it ``done``; then give back ``at_hand``: the bytes of shard
        objects in ``have``, and the objects kept in memory for them."""
        decode_locks = self.tiers.decode_locks
        assert decode_locks is not None
        REUSE.on = True  # this thread builds one shard at a time: reuse its scratch
        try:
            have.update(later.wait())
            self.builder_source.remember_indexes(indexes)
            for layout, s, _, key in todo:
                need = self._shard_chunks(layout, s)
                rest = self._others(need, have)
                with FORK_GATE.held():  # its fetch (tier lookups) and fill (SQLite, blosc)
                    if rest:
                        have.update(
                            ((la.path, k), r)
                            for (la, k), r in zip(rest, self.builder_source.raw(rest, ram=False))
                        )
                    raw = [have.pop((la.path, k)) for la, k in need]
                    self.fill([(layout, s, Span(0, 0), key)], need, raw)
                del raw
                decode_locks.release(locks.pop(key))
                self.fill_chunks.drop(need)
                done(key)
        finally:
            for held in locks.values():  # a build that failed: its shards stay out
                decode_locks.release(held)
            for layout, s, _, _ in todo:
                self.fill_chunks.drop(self._shard_chunks(layout, s))
            have.clear()
            later.got.clear()
            self.at_hand.give(at_hand[0] + later.nbytes)
            self.source.let_go(at_hand[1])
        with self.values.lock:
            self.values.drop_evicted()
        release_free_memory()
