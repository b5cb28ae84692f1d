"""Building shards into the RAM tier: behind the reads (the default), or inline in the
read that first touches them (``zstore cache warm``).  :class:`ShardFills` is the part
of :class:`zstore.read._ram_shards.ShardForm` that builds; the form decides what to
build (admission, its maps) and how a shard is laid out (``fill``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from zstore.cache import Tier, TieredCache
from zstore.format import ArrayLayout, Span
from zstore.read._builds import FORK_GATE, BehindBuilds, ByteBudget
from zstore.read._chunks import ChunkSource
from zstore.read._maps import Mapped, MappedValues
from zstore.read._shard_pieces import REUSE, Pieces, Plan, lazy_pieces, release_free_memory


class ShardFills:
    """The builds of a :class:`zstore.read._ram_shards.ShardForm` (which defines what
    is declared here)."""

    if TYPE_CHECKING:
        tiers: TieredCache
        source: ChunkSource
        builder_source: ChunkSource
        values: MappedValues
        ram: Tier
        behind: BehindBuilds
        at_hand: ByteBudget
        chunk_bytes: int

        def key(self, layout: ArrayLayout, s: int) -> str: ...

        def _mapped(
            self, layout: ArrayLayout, s: int, key: str, *, again: bool = False
        ) -> Mapped | None: ...

        def read(self, layout: ArrayLayout, s: int, got: Mapped, span: Span) -> Pieces | None: ...

        def fill(
            self,
            todo: list[tuple[ArrayLayout, int, Span, str]],
            need: list[tuple[ArrayLayout, int]],
            raw: list[tuple[Any, Any]],
        ) -> Pieces: ...

    def _build(self, missing: list[tuple[ArrayLayout, int, Span]], direct: Plan) -> Pieces:
        """Build missing shards into the RAM tier, once for the node (under its lock),
        behind the reads (see :mod:`zstore.read._builds`); the pieces of their spans and
        of ``direct`` (spans read from their chunks: encoded chunks stay out of the RAM
        tier, it holds shards).

        The windows are served from their own chunks, fetched now, and the rest of each
        build (the shard's other chunks, decoding, writing the tier) goes to the thread
        behind the reads with the node's lock, released there once the shard is in: the
        origin is read once per chunk for the node.  A shard whose lock another process
        (or this one's builder) holds, or that finds the queue full, is read from its
        chunks and asked for again on its next read.  All of these chunks are fetched
        in one round (``zstore cache warm`` builds inline instead: _build_inline)."""
        pieces: Pieces = {}
        around: Plan = []
        todo: list[tuple[ArrayLayout, int, Span, str]] = []
        locks: dict[str, list[int]] = {}
        decode_locks = self.tiers.decode_locks
        assert decode_locks is not None  # a RAM tier has them
        try:
            for layout, s, span in missing:
                key = self.key(layout, s)
                held = (
                    decode_locks.acquire([key], wait=False)
                    if self.behind.has_room(len(todo) + 1)
                    else None
                )
                if held is None:
                    around.append(("", layout, span))
                    continue
                found = self._built_meanwhile(layout, s, span, key)
                if found is not None:
                    decode_locks.release(held)
                    pieces.update(found)
                    continue
                todo.append((layout, s, span, key))
                locks[key] = held
            chunks = [
                (layout, k)
                for _, layout, span in [*direct, *around]
                for k in layout.chunks_for(span.start, span.stop)
            ]
            window = [  # each span is the windows' part in its shard (see pieces)
                (layout, k)
                for layout, _, span, _ in todo
                for k in layout.chunks_for(span.start, span.stop)
            ]
            need = chunks + window
            raw = self.source.raw(need, ram=False) if need else []
            self.chunk_bytes += sum(layout.chunk_nbytes for layout, _ in need)
            pieces.update(lazy_pieces(self.source, chunks, raw[: len(chunks)]))
            if todo:
                pieces.update(self._hand_off(todo, locks, window, raw[len(chunks) :]))
        finally:
            for held in locks.values():  # what no build took over
                decode_locks.release(held)
        if missing:
            self.values.drop_evicted()
        return pieces

    def _build_inline(self, missing: list[tuple[ArrayLayout, int, Span]]) -> Pieces:
        """Build missing shards here, under the node's locks (other processes wait)."""
        keys = [self.key(layout, s) for layout, s, _ in missing]
        pieces: Pieces = {}
        with self.tiers.decode_locks.hold(keys):  # type: ignore[union-attr]
            todo = []
            for (layout, s, span), key in zip(missing, keys):
                found = self._built_meanwhile(layout, s, span, key)
                if found is None:
                    todo.append((layout, s, span, key))
                else:
                    pieces.update(found)
            if todo:
                pieces.update(self.make(todo))
        release_free_memory()
        self.values.drop_evicted()  # including what this build evicted
        return pieces

    def _built_meanwhile(self, layout: ArrayLayout, s: int, span: Span, key: str) -> Pieces | None:
        """The pieces of ``span`` when another process built shard ``s`` since it was
        looked up (rare, so it is checked whole); None when it still has to be built."""
        got = self._mapped(layout, s, key, again=True)
        found = (
            self.read(layout, s, got, span)
            if got is not None and got.checked.verify(0, len(got.checked.payload))
            else None
        )
        if found is None and got is not None:
            self.values.discard(key)
        return found

    def _hand_off(
        self,
        todo: list[tuple[ArrayLayout, int, Span, str]],
        locks: dict[str, list[int]],
        window: list[tuple[ArrayLayout, int]],
        raw: list[tuple[Any, Any]],
    ) -> Pieces:
        """The windows' pieces from their own chunks ``window``, fetched as ``raw``;
        each shard's build queued behind the reads with those chunks' bytes and its node
        lock from ``locks`` (taken out of it: the build releases them).  When the queue
        filled up meanwhile, nothing is queued and the locks stay in ``locks``."""
        pieces = lazy_pieces(self.source, window, raw)
        held = {key: locks[key] for *_, key in todo}
        have = {(layout.path, k): r for (layout, k), r in zip(window, raw)}
        # The shards' other chunks this process holds fetched whole (their SSD write
        # queued) go with them, within MAX_AT_HAND_BYTES: the fill then does not read
        # them back from the SSD tier (from the device: it writes around the page cache).
        rest = (  # looked at only where shards are fetched whole
            c
            for layout, s, _, _ in todo
            for c in self._shard_chunks(layout, s)
            if (layout.path, c[1]) not in have
        )
        at_hand = self.source.in_memory(rest)
        objs = {request[0] for request, _ in at_hand.values()}
        # the windows' own chunks in those objects are parts of them too: counted with
        # them here, not in the queue's bytes (counted there, a batch's fills found the
        # queue full behind the batch before it, and its shards were read again from
        # the SSD tier's device until a later read queued them)
        inside = sum(len(d) for r, d in raw if d is not None and r is not None and r[0] in objs)
        extra = sum(len(data) for _, data in at_hand.values()) + inside
        kept: list[str] = []
        if objs and self.at_hand.take(extra):
            have.update(at_hand)
            # and this process's reads take them from memory too until the fill is done
            kept = self.source.keep_in_memory(objs)
        else:
            extra = inside = 0
        # the shards' indexes the reader fetched: the fill does not fetch them again
        indexes = self.source.known_indexes([layout.object_key(s) for layout, s, _, _ in todo])
        build = partial(self._finish_builds, todo, have, held, indexes, (extra, kept))
        nbytes = sum(len(data) for _, data in raw if data is not None) - inside
        if self.behind.submit([key for *_, key in todo], build, nbytes):
            for key in held:
                del locks[key]
        else:
            self.at_hand.give(extra)
            self.source.let_go(kept)
        return pieces

    def _finish_builds(
        self,
        todo: list[tuple[ArrayLayout, int, Span, str]],
        have: dict[tuple[str, int], tuple[Any, Any]],
        locks: dict[str, list[int]],
        indexes: dict[str, np.ndarray],
        at_hand: tuple[int, list[str]],
        done: Callable[[str], None],
    ) -> None:
        """In the thread behind the reads: shard by shard, fetch its other chunks, build
        it into the tier, release the node's lock its reader took, mark it ``done``;
        then give back ``at_hand``: the bytes of shard objects in ``have``, and the
        objects kept in memory for them."""
        decode_locks = self.tiers.decode_locks
        assert decode_locks is not None
        REUSE.on = True  # this thread builds one shard at a time: reuse its scratch
        try:
            self.builder_source.remember_indexes(indexes)
            for layout, s, _, key in todo:
                need = self._shard_chunks(layout, s)
                rest = [(la, k) for la, k in need if (la.path, k) not in have]
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
                done(key)
        finally:
            for held in locks.values():  # a build that failed: its shards stay out
                decode_locks.release(held)
            have.clear()
            self.at_hand.give(at_hand[0])
            self.source.let_go(at_hand[1])
        with self.values.lock:
            self.values.drop_evicted()
        release_free_memory()

    def _build_behind(
        self, layout: ArrayLayout, s: int, key: str, done: Callable[[str], None]
    ) -> None:
        """Build one shard in the background thread.  The maps and the chunk source are
        used under the readers' lock; decoding and writing the shard happen outside it,
        under the node's build lock (never the readers' lock inside that one: a reader
        takes them in the other order)."""
        need = self._shard_chunks(layout, s)
        REUSE.on = True  # this thread builds one shard at a time: reuse its scratch
        with FORK_GATE.held():  # its lookups and fetch (SQLite) and fill (blosc, SQLite)
            with self.values.lock:
                if self._mapped(layout, s, key, again=True) is not None:
                    return
            raw = self.builder_source.raw(need, ram=False)
            with self.tiers.decode_locks.hold([key]):  # type: ignore[union-attr]
                if self.ram.get_mapped(key, count_miss=False) is None:  # not built elsewhere
                    self.fill([(layout, s, Span(0, 0), key)], need, raw)
            del raw
        with self.values.lock:
            self.values.drop_evicted()
        release_free_memory()

    def make(self, todo: list[tuple[ArrayLayout, int, Span, str]]) -> Pieces:
        """Build the shards of ``todo`` into the RAM tier; the pieces of their spans."""
        need = [c for layout, s, _, _ in todo for c in self._shard_chunks(layout, s)]
        return self.fill(todo, need, self.source.raw(need, ram=False))

    def _shard_chunks(self, layout: ArrayLayout, s: int) -> list[tuple[ArrayLayout, int]]:
        last = min((s + 1) * layout.chunks_per_shard, -(-layout.length // layout.chunk))
        return [(layout, k) for k in range(s * layout.chunks_per_shard, last)]
