"""Building shards into the RAM tier, other than the fills behind the reads
(:mod:`zstore.read._shard_fills`): inline, in the read that first touches them
(``zstore cache warm``), and behind the reads when a shard displaces resident ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zstore.cache import Tier, TieredCache
from zstore.format import ArrayLayout, Span
from zstore.read._builds import FORK_GATE, BehindBuilds
from zstore.read._chunks import ChunkSource
from zstore.read._maps import Mapped, MappedValues
from zstore.read._shard_pieces import REUSE, Pieces, release_free_memory


class ShardBuilds:
    """The builds of a :class:`zstore.read._ram_shards.ShardForm` other than the fills
    behind the reads (:class:`zstore.read._shard_fills.ShardFills`), and what they
    share; the form defines what is declared here."""

    if TYPE_CHECKING:
        tiers: TieredCache
        source: ChunkSource
        builder_source: ChunkSource
        values: MappedValues
        ram: Tier
        behind: BehindBuilds
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
