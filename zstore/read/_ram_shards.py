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
import logging
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np

from zstore.cache import Checked
from zstore.errors import IntegrityError
from zstore.format import EMPTY, ArrayLayout, Span, decode_chunk, strip_crc
from zstore.origin import describe
from zstore.read._builds import MAX_AT_HAND_BYTES, ByteBudget, FirstReadHold
from zstore.read._fill_chunks import FillChunks
from zstore.read._maps import Mapped
from zstore.read._ram_form import RamForm
from zstore.read._shard_fills import ShardFills
from zstore.read._shard_pieces import (
    Lazy,
    Pieces,
    Plan,
    chunk_pieces,
    copy_time,
    in_shard,
    scratch,
    scratch_chunks,
    shard_shape,
)
from zstore.read.streamcopy import widen

log = logging.getLogger("zstore")


class ShardForm(RamForm, ShardFills, abc.ABC):
    """What the two forms share: lookups through the maps, admission, building."""

    #: Shards that displace resident ones are built behind the reads (zstore.read._builds).
    later = False
    #: the reader's hold on its work behind the reads, which says whether this
    #: process's first read is running (set by the reader; None: never)
    first_reads: FirstReadHold | None = None

    def __init__(self, *args: Any, **kwargs: Any):  # RamForm's
        super().__init__(*args, **kwargs)
        source = self.source
        #: bytes of shard objects in memory that queued fills hold (see _hand_off)
        self.at_hand = ByteBudget(MAX_AT_HAND_BYTES)
        #: the builder thread's own chunk source: it fetches without the readers' lock
        self.builder_source = source.for_thread()
        #: chunks the queued fills hold, which this process's reads take from memory,
        #: and the fetches of their other chunks behind the reads (a source of its own)
        self.fill_chunks = FillChunks(source.for_thread())

    def _shards(self, layout: ArrayLayout, span: Span) -> Iterator[tuple[int, str]]:
        """The shards ``span`` of ``layout`` lies in, with their tier keys."""
        for s in range(span.start // layout.shard, (span.stop - 1) // layout.shard + 1):
            yield s, self.key(layout, s)

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
            for s, key in self._shards(layout, span):
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
        reads).  The shards neither mapped here nor in the tier are found by one query
        (:meth:`MappedValues.absent`).  During this process's first read no build is
        asked for: those shards are read from their chunks, as with no tier, and built
        when they are read again (the first batch of packed items took 1.9x of no tier's
        time with its builds queued).  Only the first read: a rank's later reads while
        the node's other first reads run queue their builds, held (skipping those too,
        4 ranks on an S3-like origin read epochs 1-3 at 0.7x).  What admission needs of
        the shards not mapped (the encoded form: their indexes) is fetched for all of
        them at once (:meth:`prepare`)."""
        decided: dict[str, Mapped | str] = {}
        wanted: dict[str, tuple[ArrayLayout, int]] = {}
        for _, layout, span in plan:
            if self.handles(layout):
                for s, key in self._shards(layout, span):
                    wanted.setdefault(key, (layout, s))
        absent = self.values.absent(list(wanted))
        unmapped: dict[str, tuple[ArrayLayout, int]] = {}
        for key, (layout, s) in wanted.items():
            got = None if key in absent else self._mapped(layout, s, key)
            if got is None:
                unmapped[key] = (layout, s)
            else:
                decided[key] = got
        first = self.first_reads is not None and self.first_reads.first_running
        if unmapped and first and not self.inline:
            return {**decided, **dict.fromkeys(unmapped, "chunks")}
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

    def _mapped(
        self, layout: ArrayLayout, s: int, key: str, *, again: bool = False
    ) -> Mapped | None:
        """This process's map of shard ``s`` in the RAM tier (see MappedValues.get)."""
        return self.values.get(key, self.view_of(layout, s), again=again)

    def view_of(self, layout: ArrayLayout, s: int) -> Callable[[Checked], Any]:
        """What maps a value of shard ``s`` (:meth:`view`, for MappedValues)."""
        return lambda checked: self.view(layout, s, checked)

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
    """Decoded shards: a warm window is one lookup and one copy per field.  A float
    array of int16 samples (``ArrayLayout.int16_samples``) is kept as those samples,
    half the bytes (float32), widened as windows are copied out."""

    suffix = "#D"
    decoded = True
    later = True  # a build decodes a whole shard (~20-30 ms)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._wide: set[str] = set()  # array paths with a shard kept wide (said once)

    def view(self, layout: ArrayLayout, s: int, checked: Checked) -> np.ndarray | None:
        """The shard as an array: of int16 samples or of the array's own dtype, as its
        size says (a shard of an int16-samples array whose values were not all samples
        was kept in its own dtype; see :meth:`fill`)."""
        shape = shard_shape(layout, s)
        dtype = layout.dtype
        if layout.int16_samples and len(checked.payload) == 2 * int(np.prod(shape)):
            dtype = layout.ram_dtype
        try:
            return np.frombuffer(checked.payload, dtype=dtype).reshape(shape)
        except ValueError:
            return None

    def nbytes(self, layout: ArrayLayout, s: int) -> int:
        return int(np.prod(shard_shape(layout, s))) * layout.ram_dtype.itemsize

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
            shard = scratch(shard_shape(layout, s), layout.ram_dtype)
            axis = layout.time_axis
            for k in range(-(-shard.shape[axis] // layout.chunk)):
                chunk = next(chunks)
                if not copy_time(shard, k * layout.chunk, chunk, axis):  # not all samples
                    shard = self._widened(layout, shard, k * layout.chunk)
                    copy_time(shard, k * layout.chunk, chunk, axis)
            self.ram.put(key, shard, blocked=True)
            pieces[(layout.path, s)] = (s * layout.shard, shard)
        del chunks  # the fetched bytes go with it, before the heap is trimmed
        return pieces

    def _widened(self, layout: ArrayLayout, shard: np.ndarray, done: int) -> np.ndarray:
        """A chunk of an int16-samples array held a value that is not a sample: the
        shard is kept in the array's own dtype instead, its first ``done`` steps (all
        samples, so exact) widened back.  Said once per array path."""
        if layout.path not in self._wide:
            self._wide.add(layout.path)
            log.warning(
                "zstore: %s: '%s' holds values that are not int16 samples, though the "
                "store's manifest says it does; its shards are kept as %s in the RAM tier "
                "(the values read are the stored ones either way)",
                self.url,
                layout.path,
                layout.dtype,
            )
        wide = np.empty(shard.shape, dtype=layout.dtype)
        part = [slice(None)] * shard.ndim
        part[layout.time_axis] = slice(0, done)
        widen(wide[tuple(part)], shard[tuple(part)])
        return wide


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
