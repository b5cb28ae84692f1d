"""Filling shards into the RAM tier behind the reads, from the read that first touches
them: :class:`ShardFills` is the part of :class:`zstore.read._ram_shards.ShardForm` that
hands a shard's fill to the thread behind the reads or to the fill process (what that
thread does with it is in :mod:`zstore.read._shard_rest`; the other builds, and what the
form declares, in :mod:`zstore.read._shard_builds`); the form decides what to build
(admission, its maps) and how a shard is laid out (``fill``)."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from zstore.format import ArrayLayout, Span
from zstore.read._fill_chunks import Chunk, RestFetch
from zstore.read._fill_process import FillProcess
from zstore.read._shard_pieces import Pieces, Plan, lazy_pieces
from zstore.read._shard_rest import ShardRest


class ShardFills(ShardRest):
    """The fills behind the reads of a :class:`zstore.read._ram_shards.ShardForm`."""

    #: the reading process's fill process, where its fills run in one
    #: (:mod:`zstore.read._fill_process`; set by the reader), else None
    fill_process: FillProcess | None = None

    def _helper(self) -> FillProcess | None:
        """The fill process, where it takes fills now (else this process's thread)."""
        helper = self.fill_process
        return helper if helper is not None and helper.ready() else None

    def _build(self, missing: list[tuple[ArrayLayout, int, Span]], direct: Plan) -> Pieces:
        """Build missing shards into the RAM tier, once for the node (under its lock),
        behind the reads (see :mod:`zstore.read._builds`); the pieces of their spans and
        of ``direct`` (spans read from their chunks: encoded chunks stay out of the RAM
        tier, it holds shards).

        The windows are served from their own chunks, fetched now, and the rest of each
        build (the shard's other chunks, decoding, writing the tier) goes to the thread
        behind the reads with the node's lock, released there once the shard is in: the
        fill reads each chunk once for the node.  A shard whose lock another process (or
        this one's builder) holds, or that finds the queue full, is read from its chunks
        and asked for again on its next read; chunks a queued fill of this process holds
        are taken from it (:mod:`zstore.read._fill_chunks`).  All of these chunks are
        fetched in one round; from a remote origin read by ranges the built shards'
        other chunks follow at once, behind the reads (``zstore cache warm`` builds
        inline instead: _build_inline)."""
        pieces: Pieces = {}
        around: Plan = []
        todo: list[tuple[ArrayLayout, int, Span, str]] = []
        locks: dict[str, list[int]] = {}
        decode_locks = self.tiers.decode_locks
        assert decode_locks is not None  # a RAM tier has them
        queue = self._helper() or self.behind
        try:
            for layout, s, span in missing:
                key = self.key(layout, s)
                held = (
                    decode_locks.acquire([key], wait=False)
                    if queue.has_room(len(todo) + 1)
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
            held_chunks, held_raw, chunks = self.fill_chunks.split(chunks)
            need = chunks + window
            raw = self.source.raw(need, ram=False) if need else []
            self.chunk_bytes += sum(la.chunk_nbytes for la, _ in held_chunks + need)
            pieces.update(lazy_pieces(self.source, held_chunks, held_raw))
            pieces.update(lazy_pieces(self.source, chunks, raw[: len(chunks)]))
            if todo:
                pieces.update(self._hand_off(todo, locks, window, raw[len(chunks) :]))
        finally:
            for held in locks.values():  # what no build took over
                decode_locks.release(held)
        if missing:
            self.values.drop_evicted()
        return pieces

    def _hand_off(
        self,
        todo: list[tuple[ArrayLayout, int, Span, str]],
        locks: dict[str, list[int]],
        window: list[Chunk],
        raw: list[tuple[Any, Any]],
    ) -> Pieces:
        """The windows' pieces from their own chunks ``window``, fetched as ``raw``;
        each shard's build queued behind the reads with those chunks' bytes and its node
        lock from ``locks`` (taken out of it: the build releases them).  From a remote
        origin read by ranges, the shards' other chunks are fetched behind the reads at
        once (within MAX_AT_HAND_BYTES), not by the build in its turn; until a build is
        done, this process's reads take its chunks from ``fill_chunks``.  When the queue
        filled up meanwhile, nothing is queued and the locks stay in ``locks``."""
        pieces = lazy_pieces(self.source, window, raw)
        held = {key: locks[key] for *_, key in todo}
        have = {(layout.path, k): r for (layout, k), r in zip(window, raw)}
        # the shards' indexes the reader fetched: the fill does not fetch them again
        indexes = self.source.known_indexes([layout.object_key(s) for layout, s, _, _ in todo])
        helper = self._helper()
        if helper is not None and self.source.fetch != "shard":
            self._hand_to_process(helper, todo, locks, window, raw, have, indexes)
            return pieces
        # The shards' other chunks this process holds fetched whole (their SSD write
        # queued) go with them, within MAX_AT_HAND_BYTES: the fill then does not read
        # them back from the SSD tier (from the device: it writes around the page cache).
        others = (  # looked at only where shards are fetched whole
            c for layout, s, _, _ in todo for c in self._others(self._shard_chunks(layout, s), have)
        )
        at_hand = self.source.in_memory(others)
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
        rest, rest_bytes = self._rest_of(todo, have, indexes)
        later = RestFetch()
        build = partial(self._finish_builds, todo, have, held, indexes, (extra, kept), later)
        nbytes = sum(len(data) for _, data in raw if data is not None) - inside
        # registered first: the builder may drop them as soon as the build is queued
        self.fill_chunks.add(window, raw)
        if self.behind.submit([key for *_, key in todo], build, nbytes):
            for key in held:
                del locks[key]
            self._fetch_rest(rest, rest_bytes, indexes, later)
        else:
            self.fill_chunks.drop(window)
            self.at_hand.give(extra)
            self.source.let_go(kept)
        return pieces

    def _hand_to_process(
        self,
        helper: FillProcess,
        todo: list[tuple[ArrayLayout, int, Span, str]],
        locks: dict[str, list[int]],
        window: list[Chunk],
        raw: list[tuple[Any, Any]],
        have: dict[tuple[str, int], tuple[Any, Any]],
        indexes: dict[str, np.ndarray],
    ) -> None:
        """:meth:`_hand_off` to the fill process: the shards' builds, the windows' chunks'
        bytes and the node's locks go to it (:mod:`zstore.read._fill_process`), which
        fetches the shards' other chunks itself; until a shard is in, this process's
        reads take those chunks from ``fill_chunks``.  Where the helper does not take
        them, nothing is queued and the locks stay in ``locks``."""
        decode_locks = self.tiers.decode_locks
        assert decode_locks is not None
        chunks_of = {key: self._shard_chunks(layout, s) for layout, s, _, key in todo}
        nbytes = sum(len(data) for _, data in raw if data is not None)
        self.fill_chunks.add(window, raw)
        shards = [(layout, s, key, locks[key]) for layout, s, _, key in todo]
        if helper.submit(
            shards, have, indexes, nbytes, lambda key: self.fill_chunks.drop(chunks_of[key])
        ):
            for key in chunks_of:  # the helper holds them now, through its own copies
                decode_locks.release(locks.pop(key))
        else:
            self.fill_chunks.drop(window)
