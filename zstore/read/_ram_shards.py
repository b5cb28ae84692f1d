"""Whole shards in the RAM tier, mapped once per process: decoded or encoded.

Both forms work alike (:class:`ShardForm`): a window's shard is served from this
process's map of it, else built once for the node (under a lock) when the RAM tier
admits it, else the window's chunks in it are read from the SSD tier or the origin
and decoded (:func:`chunk_pieces`).

- :class:`DecodedShards`: the shard decoded; a warm window is one copy per field.
- :class:`EncodedShards`: the shard's encoded chunks and an index of them; a warm window
  decodes its chunks straight from the map: no lookup, no read, no copy of bytes.
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import mmap
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np

from zstore.cache import Checked, TieredCache
from zstore.errors import IntegrityError
from zstore.format import EMPTY, ArrayLayout, Span, decode_chunk, strip_crc
from zstore.origin import describe
from zstore.read._builds import FORK_GATE, BehindBuilds
from zstore.read._chunks import ChunkSource
from zstore.read._maps import Mapped, MappedValues

SCRATCH_MMAP = 2**20  # decoded shards from this size up are built outside the heap
#: Decoded chunk bytes after which the reader trims the heap (then counts again).
#: Trimming after every window read as chunks made the next window page-fault its
#: temporaries back in, which doubled the time to read and decode a chunk and made a
#: RAM tier holding a third of the data slower than none; never trimming let each
#: reader's private memory grow ~20-30 MB per pass over its windows (glibc keeps freed
#: heap), and every 64 MB still ~10 MB.  Every ~3 windows (16 MB) keeps it flat with 4
#: ranks, and costs a fraction of a refault per window (docs/benchmarks-notes.md).
TRIM_AFTER = 16 * 2**20
Plan = list[tuple[str, ArrayLayout, Span]]


class Lazy:
    """A chunk still encoded, decoded when a window is copied out of it: one chunk at a
    time, so it is copied while it is still in the CPU's cache, and a read holds one
    decoded chunk instead of a window's (measured: decoding a window's chunks first and
    copying them after cost ~0.3 ms a window more than decode-and-copy per chunk)."""

    __slots__ = ("shape", "nbytes", "_decode")

    def __init__(self, layout: ArrayLayout, decode: Callable[..., np.ndarray]):
        self.shape = layout.chunk_shape
        self.nbytes = layout.chunk_nbytes
        self._decode = decode

    def decoded(self) -> np.ndarray:
        """The chunk, decoded into this thread's scratch buffer: valid until the
        thread decodes its next chunk, so copy it out at once."""
        buf = getattr(_SCRATCH, "buf", None)
        if buf is None or len(buf) < self.nbytes:
            buf = _SCRATCH.buf = np.empty(self.nbytes, dtype=np.uint8)
        return self._decode(out=buf)


_SCRATCH = threading.local()  # one chunk's decode buffer per thread


#: (path, n) -> (time offset, array or chunk to decode)
Pieces = dict[tuple[str, int], tuple[int, "np.ndarray | Lazy"]]


def chunk_pieces(source: ChunkSource, plan: Plan, *, ram: bool) -> Pieces:
    """The window's chunks, to decode as they are copied (keys ``(path, -1 - k)``,
    apart from shards')."""
    need = [
        (layout, k) for _, layout, span in plan for k in layout.chunks_for(span.start, span.stop)
    ]
    return lazy_pieces(source, need, source.raw(need, ram=ram))


def lazy_pieces(
    source: ChunkSource, need: list[tuple[ArrayLayout, int]], raw: list[tuple[Any, Any]]
) -> Pieces:
    """The pieces of chunks ``need`` from their bytes ``raw`` (``source.raw(need)``),
    each decoded as it is copied."""
    return {
        (layout.path, -1 - k): (
            k * layout.chunk,
            Lazy(layout, partial(source.decode, layout, request, data)),
        )
        for (layout, k), (request, data) in zip(need, raw)
    }


def scratch_chunks(
    source: ChunkSource, need: list[tuple[ArrayLayout, int]], raw: list[tuple[Any, Any]]
) -> Iterator[np.ndarray]:
    """The chunks of ``raw`` (``source.raw(need)``) decoded one at a time into this
    thread's scratch buffer (each valid until the next: copy it into the shard at once),
    their bytes dropped from ``raw`` as they go.  Building a shard then allocates nothing
    per chunk: a build behind the reads runs in its own thread, whose malloc arena kept
    the decoded chunks' memory (measured: 4 ranks grew ~5 MB each over a second pass)."""
    for i, (layout, _) in enumerate(need):
        request, data = raw[i]
        raw[i] = (None, None)
        yield Lazy(layout, partial(source.decode, layout, request, data)).decoded()
        del data


MAX_KEYS = 1 << 16  # shard keys a form remembers (a dict of short strings)


def in_shard(layout: ArrayLayout, s: int, span: Span) -> Span:
    """The part of ``span`` that lies in shard ``s``."""
    return Span(max(span.start, s * layout.shard), min(span.stop, (s + 1) * layout.shard))


class ShardForm(abc.ABC):
    """What the two forms share: lookups through the maps, admission, building."""

    suffix = ""
    #: Shards that displace resident ones are built behind the reads (zstore.read._builds).
    later = False
    #: Build shards in the read that first touches them, waiting for the node's lock
    #: (``zstore cache warm``), instead of behind the reads.
    inline = False

    def __init__(
        self,
        url: str,
        tiers: TieredCache,
        source: ChunkSource,
        values: MappedValues,
        behind: BehindBuilds,
    ):
        self.url, self.tiers, self.source, self.values = url, tiers, source, values
        self.ram = values.tier
        self.chunk_bytes = 0  # decoded bytes of chunks read since the heap was last trimmed
        self.behind = behind  # the reader's fills queue (zstore.read._builds)
        #: the builder thread's own chunk source: it fetches without the readers' lock
        self.builder_source = ChunkSource(
            source.url, source.origin, source.tiers, source.fetch, source.complete
        )
        # tier keys by (array path, shard): a batch of short windows looks up ~50 shards
        self._keys: dict[tuple[str, int], str] = {}

    def key(self, layout: ArrayLayout, s: int) -> str:
        """The tier key of shard ``s`` of ``layout`` in this form."""
        key = self._keys.get((layout.path, s))
        if key is None:
            if len(self._keys) >= MAX_KEYS:
                self._keys.clear()
            key = self._keys[(layout.path, s)] = self.tiers.key(
                f"{layout.object_key(s)}{self.suffix}"
            )
        return key

    def pieces(self, plan: Plan) -> Pieces:
        """Pieces covering every span of ``plan``.  Where each shard is read from (this
        process's map, a build now, or its chunks) is decided once per call: a batch's
        windows of one shard never mix its map with its chunks (a build behind the
        reads, or another process, may put the shard in the tier between two of them)."""
        pieces: Pieces = {}
        missing: dict[str, tuple[ArrayLayout, int, Span]] = {}
        direct: Plan = []
        decided = self._decide(plan)
        for name, layout, span in plan:
            if not self.handles(layout):
                direct.append((name, layout, span))
                continue
            for s in range(span.start // layout.shard, (span.stop - 1) // layout.shard + 1):
                key = self.key(layout, s)
                where = decided[key]
                if isinstance(where, Mapped):
                    found = self.read(layout, s, where, span)
                    if found is not None:
                        pieces.update(found)
                        continue
                    self.values.discard(key)  # failed its check: this batch reads chunks
                    where = decided[key] = "chunks"
                if where == "build":
                    part = in_shard(layout, s, span)
                    if key in missing:  # one build, covering every window of the batch
                        _, _, had = missing[key]
                        part = Span(min(had.start, part.start), max(had.stop, part.stop))
                    missing[key] = (layout, s, part)
                    continue
                # the part of the window in this shard, from its chunks
                direct.append((name, layout, in_shard(layout, s, span)))
        if missing and self.inline:  # ``zstore cache warm``: built here
            pieces.update(self._build_inline(list(missing.values())))
            missing.clear()
        if missing or direct:
            pieces.update(self._build(list(missing.values()), direct))
        return pieces

    def _decide(self, plan: Plan) -> dict[str, Mapped | str]:
        """Where a call reads each shard of ``plan`` from, by key: this process's map of
        it, ``"build"`` (into the tier, under the node's lock: see :meth:`_build`), or
        ``"chunks"`` (a shard that displaces resident ones, its build queued behind the
        reads).  What admission needs of the shards not mapped (the encoded form: their
        indexes) is fetched for all of them at once (:meth:`prepare`)."""
        decided: dict[str, Mapped | str] = {}
        unmapped: dict[str, tuple[ArrayLayout, int]] = {}
        for _, layout, span in plan:
            if not self.handles(layout):
                continue
            for s in range(span.start // layout.shard, (span.stop - 1) // layout.shard + 1):
                key = self.key(layout, s)
                if key not in decided and key not in unmapped:
                    got = self._mapped(layout, s, key)
                    if got is None:
                        unmapped[key] = (layout, s)
                    else:
                        decided[key] = got
        if unmapped:
            self.prepare(list(unmapped.values()))
        for key, (layout, s) in unmapped.items():
            decided[key] = self._where(layout, s, key)
        return decided

    def prepare(self, shards: list[tuple[ArrayLayout, int]]) -> None:  # noqa: B027
        """Fetch together what :meth:`nbytes` needs of ``shards`` (nothing by default)."""

    def _where(self, layout: ArrayLayout, s: int, key: str) -> str:
        """Where a call reads shard ``s``, which this process has not mapped, from:
        ``"build"`` or ``"chunks"`` (see :meth:`_decide`)."""
        how = (
            None
            if key in self.behind
            else self.ram.admits_as(key, self.nbytes(layout, s), blocked=True)
        )
        if how == "room" or (how == "displace" and (self.inline or not self.later)):
            return "build"
        if how == "displace":
            self.behind.submit(key, partial(self._build_behind, layout, s, key))
        return "chunks"

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
            raw = self.source.raw(chunks + window, ram=False) if chunks or window else []
            self.chunk_bytes += sum(layout.chunk_nbytes for layout, _ in chunks + window)
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
        # the shards' indexes the reader fetched: the fill does not fetch them again
        indexes = self.source.known_indexes([layout.object_key(s) for layout, s, _, _ in todo])
        build = partial(self._finish_builds, todo, have, held, indexes)
        nbytes = sum(len(data) for _, data in raw if data is not None)
        if self.behind.submit([key for *_, key in todo], build, nbytes):
            for key in held:
                del locks[key]
        return pieces

    def _finish_builds(
        self,
        todo: list[tuple[ArrayLayout, int, Span, str]],
        have: dict[tuple[str, int], tuple[Any, Any]],
        locks: dict[str, list[int]],
        indexes: dict[str, np.ndarray],
        done: Callable[[str], None],
    ) -> None:
        """In the thread behind the reads: shard by shard, fetch its other chunks, build
        it into the tier, release the node's lock its reader took, mark it ``done``."""
        decode_locks = self.tiers.decode_locks
        assert decode_locks is not None
        _REUSE.on = True  # this thread builds one shard at a time: reuse its scratch
        self.builder_source.remember_indexes(indexes)
        try:
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
        _REUSE.on = True  # this thread builds one shard at a time: reuse its scratch
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

    def _mapped(
        self, layout: ArrayLayout, s: int, key: str, *, again: bool = False
    ) -> Mapped | None:
        """This process's map of shard ``s`` in the RAM tier (see MappedValues.get)."""
        return self.values.get(key, self.view_of(layout, s), again=again)

    def view_of(self, layout: ArrayLayout, s: int) -> Callable[[Checked], Any]:
        """What maps a value of shard ``s`` (:meth:`view`, for MappedValues)."""
        return lambda checked: self.view(layout, s, checked)

    def make(self, todo: list[tuple[ArrayLayout, int, Span, str]]) -> Pieces:
        """Build the shards of ``todo`` into the RAM tier; the pieces of their spans."""
        need = [c for layout, s, _, _ in todo for c in self._shard_chunks(layout, s)]
        return self.fill(todo, need, self.source.raw(need, ram=False))

    def _shard_chunks(self, layout: ArrayLayout, s: int) -> list[tuple[ArrayLayout, int]]:
        last = min((s + 1) * layout.chunks_per_shard, -(-layout.length // layout.chunk))
        return [(layout, k) for k in range(s * layout.chunks_per_shard, last)]

    # what a form defines
    def handles(self, layout: ArrayLayout) -> bool:
        """Whether shards of ``layout`` take this form (else its windows read chunks)."""
        return True

    @abc.abstractmethod
    def view(self, layout: ArrayLayout, s: int, checked: Checked) -> Any:
        """What a mapped value of shard ``s`` is read through; None when it is corrupt."""

    @abc.abstractmethod
    def read(self, layout: ArrayLayout, s: int, got: Mapped, span: Span) -> Pieces | None:
        """The pieces of ``span`` from a mapped shard; None when a check fails."""

    @abc.abstractmethod
    def nbytes(self, layout: ArrayLayout, s: int) -> int:
        """Bytes shard ``s`` takes in this form (what admission weighs)."""

    @abc.abstractmethod
    def fill(
        self,
        todo: list[tuple[ArrayLayout, int, Span, str]],
        need: list[tuple[ArrayLayout, int]],
        raw: list[tuple[Any, Any]],
    ) -> Pieces:
        """Build the shards of ``todo`` into the RAM tier from ``raw``, the encoded bytes
        of their chunks ``need`` (``source.raw(need)``); the pieces of their spans."""


class DecodedShards(ShardForm):
    """Decoded shards: a warm window is one lookup and one copy per field."""

    suffix = "#D"
    later = True  # a build decodes a whole shard (~20-30 ms)

    def view(self, layout: ArrayLayout, s: int, checked: Checked) -> np.ndarray | None:
        try:
            return np.frombuffer(checked.payload, dtype=layout.dtype).reshape(
                shard_shape(layout, s)
            )
        except ValueError:
            return None

    def nbytes(self, layout: ArrayLayout, s: int) -> int:
        return int(np.prod(shard_shape(layout, s))) * layout.dtype.itemsize

    def read(self, layout: ArrayLayout, s: int, got: Mapped, span: Span) -> Pieces | None:
        """Check the blocks of the mapped shard this span reads (once per process)."""
        arr, checked = got.view, got.checked
        if not checked.complete:
            offset, axis, isz = s * layout.shard, layout.time_axis, arr.itemsize
            lo = max(span.start, offset) - offset
            hi = min(span.stop, offset + arr.shape[axis]) - offset
            if axis == arr.ndim - 1:
                t = arr.shape[-1]
                good = all(
                    checked.verify((r * t + lo) * isz, (r * t + hi) * isz)
                    for r in range(arr.size // t)
                )
            elif axis == 0:
                row = arr.nbytes // arr.shape[0]
                good = checked.verify(lo * row, hi * row)
            else:
                good = checked.verify(0, arr.nbytes)
            if not good:
                return None
        return {(layout.path, s): (s * layout.shard, arr)}

    def fill(
        self,
        todo: list[tuple[ArrayLayout, int, Span, str]],
        need: list[tuple[ArrayLayout, int]],
        raw: list[tuple[Any, Any]],
    ) -> Pieces:
        chunks = scratch_chunks(self.source, need, raw)
        pieces: Pieces = {}
        for layout, s, _, key in todo:
            shard = _scratch(shard_shape(layout, s), layout.dtype)
            for k in range(-(-shard.shape[layout.time_axis] // layout.chunk)):
                _copy_time(shard, k * layout.chunk, next(chunks), layout.time_axis)
            self.ram.put(key, shard, blocked=True)
            pieces[(layout.path, s)] = (s * layout.shard, shard)
        del chunks  # the fetched bytes go with it, before the heap is trimmed
        return pieces


class EncodedShards(ShardForm):
    """Encoded shards: the chunks' stored bytes, then an index of (offset, nbytes)."""

    suffix = "#E"

    def handles(self, layout: ArrayLayout) -> bool:
        return layout.sharded  # one object per chunk already is its own "shard"

    def _count(self, layout: ArrayLayout, s: int) -> int:
        return len(self._shard_chunks(layout, s))

    def view(self, layout: ArrayLayout, s: int, checked: Checked) -> list[list[int]] | None:
        n, size = self._count(layout, s), len(checked.payload)
        if size < 16 * n or not checked.verify(size - 16 * n, size):
            return None
        # a list: read once per process, then indexed per chunk at Python speed
        return np.frombuffer(checked.payload[size - 16 * n :], dtype="<u8").reshape(n, 2).tolist()

    def prepare(self, shards: list[tuple[ArrayLayout, int]]) -> None:
        """The shards' indexes in one origin round: fetched one per shard by
        :meth:`nbytes`, a batch's first touches made a round per shard.  An index whose
        node lock is held now is fetched without it (and not kept): the read does not
        wait for a lock another process's held work may keep (a 4-rank job on an
        S3-like origin hung on one)."""
        self.source.index([(layout, s) for layout, s in shards if layout.sharded], wait=False)

    def nbytes(self, layout: ArrayLayout, s: int) -> int:
        index = self.source.index([(layout, s)])[layout.object_key(s)]
        used = index[: self._count(layout, s)]
        return int(used[used[:, 0] != EMPTY, 1].sum()) + 16 * len(used)

    def read(self, layout: ArrayLayout, s: int, got: Mapped, span: Span) -> Pieces | None:
        """The chunks of ``span``, their blocks checked, to decode as they are copied."""
        pieces: Pieces = {}
        first = s * layout.chunks_per_shard
        payload = got.checked.payload
        part = in_shard(layout, s, span)
        where = f"{self.url}: {layout.object_key(s)} (encoded shard in the RAM tier)"
        index, key = got.view, self.key(layout, s)
        for k in layout.chunks_for(part.start, part.stop):
            offset, n = index[k - first]
            if not got.checked.verify(offset, offset + n):
                return None
            pieces[(layout.path, -1 - k)] = (
                k * layout.chunk,
                Lazy(
                    layout,
                    partial(
                        self._decode, layout, k, key, got.ino, payload[offset : offset + n], where
                    ),
                ),
            )
        return pieces

    def _decode(
        self,
        layout: ArrayLayout,
        k: int,
        key: str,
        ino: int,
        data: Any,
        where: str,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Chunk ``k`` decoded from the shard; a chunk that fails its own checksum (the
        shard was damaged after its blocks were checked) drops the shard for every
        process, and the chunk is read from the origin instead."""
        try:
            return decode_chunk(layout, data, where, out)
        except IntegrityError:
            self.ram.drop(key, ino)  # rebuilt on a later read; others unmap it
            ((request, raw),) = self.source.raw([(layout, k)], ram=False)
            return self.source.decode(layout, request, raw, out)

    def fill(
        self,
        todo: list[tuple[ArrayLayout, int, Span, str]],
        need: list[tuple[ArrayLayout, int]],
        raw: list[tuple[Any, Any]],
    ) -> Pieces:
        pieces: Pieces = {}
        pos = 0
        for layout, s, span, key in todo:
            n = self._count(layout, s)
            got = raw[pos : pos + n]
            pos += n
            if any(data is None for _, data in got):  # unwritten chunks (other writers)
                pieces.update(
                    chunk_pieces(self.source, [("", layout, in_shard(layout, s, span))], ram=False)
                )
                continue
            parts = [self._checked(layout, request, data) for request, data in got]
            sizes = np.array([len(data) for data in parts], dtype="<u8")
            index = np.stack([np.cumsum(sizes) - sizes, sizes], axis=1)  # (offset, nbytes)
            buf = b"".join([*parts, index.tobytes()])
            self.ram.put(key, buf, blocked=True)
            built = Mapped(index.tolist(), Checked(memoryview(buf), None), "", 0)
            found = self.read(layout, s, built, span)
            assert found is not None  # every chunk was checked above
            pieces.update(found)
        return pieces

    def _checked(self, layout: ArrayLayout, request: Any, data: Any) -> bytes | memoryview:
        """A chunk's bytes with their crc32c checked (refetched from the origin once when
        the copy in a tier is bad), so a shard is never built from corrupt bytes."""
        if not any(c["name"] == "crc32c" for c in layout.codecs):
            return data
        where = f"{self.url}: {describe(*request)}"
        try:
            strip_crc(memoryview(data), where)
            return data
        except IntegrityError:
            fresh = self.source.origin.read(*request)
            strip_crc(memoryview(fresh), where)
            return fresh


def shard_shape(layout: ArrayLayout, s: int) -> tuple[int, ...]:
    shape = list(layout.shape)
    shape[layout.time_axis] = min(layout.shard, layout.length - s * layout.shard)
    return tuple(shape)


def _copy_time(dst: np.ndarray, offset: int, src: np.ndarray, axis: int) -> None:
    """Copy ``src`` into ``dst`` at ``offset`` along ``axis``, clipped to ``dst``."""
    n = min(src.shape[axis], dst.shape[axis] - offset)
    d = [slice(None)] * dst.ndim
    s = [slice(None)] * dst.ndim
    d[axis], s[axis] = slice(offset, offset + n), slice(0, n)
    dst[tuple(d)] = src[tuple(s)]


def _scratch(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An array for a decoded shard; a large one gets its own anonymous mapping, returned
    to the OS as soon as the array is freed.

    A decoded shard (tens of MB) lives only until it is in the RAM tier and the window
    is copied out.  Taken from malloc, freeing it would raise glibc's dynamic mmap
    threshold to its size; from then on shard-sized temporaries would come from the
    heap, which keeps freed pages, and each process would hold tens of MB that the
    shared tier exists to save (measured, see docs/benchmarks.md).
    """
    count = int(np.prod(shape))
    nbytes = count * dtype.itemsize
    if nbytes < SCRATCH_MMAP:
        return np.empty(shape, dtype=dtype)
    if _REUSE.on:  # the builder thread: one mapping, kept while builds are queued
        if _REUSE.buf is None or len(_REUSE.buf) < nbytes:
            _REUSE.buf = None
            _REUSE.buf = mmap.mmap(-1, nbytes)
        buf = _REUSE.buf
    else:
        buf = mmap.mmap(-1, nbytes)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


class _Reused(threading.local):
    """The builder thread's scratch for decoded shards.  A fresh mapping per build
    page-faulted its whole size in (measured: 0.38 s of a first epoch's 1.47 s went to
    copying chunks into fresh scratch); one kept while builds are queued faults once,
    and is unmapped when the queue drains (``drop_reused_scratch``)."""

    on = False
    buf: mmap.mmap | None = None


_REUSE = _Reused()


def drop_reused_scratch() -> None:
    _REUSE.buf = None


@contextlib.contextmanager
def reused_scratch() -> Iterator[None]:
    """This thread's shard builds share one scratch mapping, as the builder thread's
    do: for a caller that drops the pieces a build returns (``zstore cache warm``),
    since the next build overwrites them.  A fresh mapping per shard page-faulted its
    whole size in: copying chunks into it took 0.30 s of a 1.44 s single-thread warm of
    480 MB (docs/benchmarks-notes.md)."""
    was, _REUSE.on = _REUSE.on, True
    try:
        yield
    finally:
        _REUSE.on = was


def release_free_memory() -> None:
    """Hand freed heap back to the OS (glibc keeps it after large temporaries such as the
    decoded shards, and per-process memory is what the shared RAM tier exists to save)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None
