"""Window -> chunk keys -> bytes through the tiers -> decoded arrays.  The hot path.

With a RAM tier the unit in RAM is a whole shard (up to 64 s of one array), decoded or
encoded (``ram_format``, see :mod:`zstore.read._ram_shards`), mapped read-only and kept mapped
by each process (:mod:`zstore.read._maps`): a warm window is one dict lookup per field and
then one copy (decoded) or the decode of its chunks (encoded).  A shard missing from
RAM is built from its chunks once for the node when the RAM tier admits it; otherwise,
and without a RAM tier, the reader fetches and decodes only the chunks the window
overlaps (see :mod:`zstore.read._chunks`).  Layouts the reader does not handle go through
zarr's own indexing.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from zstore.cache import (
    CacheConfig,
    FirstReads,
    FormatChoice,
    ResolvedCache,
    TieredCache,
    make_dir,
    open_file,
)
from zstore.cache import choose as choose_format
from zstore.cache import record as record_format
from zstore.errors import IntegrityError
from zstore.format import (
    VERIFIED,
    ArrayLayout,
    Span,
    field_sizes,
    read_manifest,
    verified_tables,
)
from zstore.origin import Origin
from zstore.read._builds import MAX_WRITE_BYTES, BehindBuilds, FirstReadHold
from zstore.read._chunks import ChunkSource
from zstore.read._maps import MappedValues
from zstore.read._packed_batch import packed_batch, packed_read
from zstore.read._ram_shards import DecodedShards, EncodedShards, ShardForm
from zstore.read._reader_meta import ItemPlaces
from zstore.read._shard_pieces import (
    TRIM_AFTER,
    Lazy,
    Pieces,
    chunk_pieces,
    drop_reused_scratch,
    release_free_memory,
    reused_scratch,
)
from zstore.read._zarr_store import CachedStore
from zstore.read.streamcopy import copy_values
from zstore.urls import is_url, local_path

PASSES = 8  # admission counts are halved every PASSES x (values of the store) accesses


class WindowReader(ItemPlaces):
    """Reads windows of a zstore store.  Opens lazily, once per process; pickles small."""

    def __init__(
        self,
        url: str,
        *,
        cache: CacheConfig | None = None,
        storage_options: dict[str, Any] | None = None,
        origin_fs: Any = None,
        fields: Sequence[str] | None = None,
    ):
        self.url = str(url) if is_url(str(url)) else os.path.abspath(local_path(str(url)))
        self.cache = cache
        self.storage_options = dict(storage_options or {})
        self.origin_fs = origin_fs
        self.fields = list(fields) if fields is not None else None  # sizes the RAM format
        self._pid = -1
        #: The store's root header as this reader first read it (format 2): a process
        #: this reader is pickled to sees the same items, even after an append.
        self._header: dict[str, Any] | None = None
        #: The node directory this process keeps its copy of the item table in (None:
        #: no cache tier, the table is in the process).
        self._tables_dir: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "cache": self.cache,
            "storage_options": self.storage_options,
            "origin_fs": self.origin_fs,
            "fields": self.fields,
            "header": self._header,
            "tables": verified_tables(self._header.get("table"), self._tables_dir)
            if self._header and self._tables_dir
            else set(),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(
            self,
            state["url"],
            cache=state["cache"],
            storage_options=state["storage_options"],
            origin_fs=state["origin_fs"],
            fields=state.get("fields"),
        )
        self._header = state.get("header")
        VERIFIED.update(state.get("tables", ()))

    def open(self) -> WindowReader:
        """Read the manifest and set up this process's handles (idempotent per process)."""
        if self._pid == os.getpid():
            return self
        resolved: ResolvedCache | None = (
            self.cache.resolved().for_store(self.url, origin_fs=self.origin_fs)
            if self.cache
            else None
        )
        self.tiers: TieredCache | None = None

        def tables(store_id: str) -> str | None:  # item tables: one copy per node
            self.tiers = TieredCache(resolved, store_id) if resolved else None
            where = self.tiers.node_dir("tables") if self.tiers else None
            # made with the tier's ownership and mode, or not used
            self._tables_dir = where if where is not None and make_dir(where) is None else None
            return self._tables_dir

        self.manifest, self._metas = read_manifest(
            self.url, self.storage_options, self.origin_fs, tables, self._header, open_file
        )
        if self.manifest.shapes is not None:  # format 2: workers keep this view
            self._header = self.manifest.header()
        if resolved and self.tiers is None:
            self.tiers = TieredCache(resolved, self.manifest.store_id)
        self.format_choice = self._choose_format(resolved) if self.tiers and resolved else None
        self.origin = Origin(
            self.url,
            self.storage_options,
            fs=self.origin_fs,
            max_requests=resolved.max_requests if resolved else 16,
        )
        #: The node's SSD tier can hold the whole store (as the manifest sizes it).
        self.ssd_holds_store = (
            resolved is not None
            and resolved.ssd_dir is not None
            and resolved.ssd_bytes >= int(self.manifest.extra.get("store_bytes", 2**62))
        )
        self.fetch = self._fetch_mode(resolved)
        #: this process's work behind the reads: RAM fills, and whole-shard SSD writes;
        #: both held until its first read is served (see ``start_builds``), and
        #: HOLD_AT_MOST seconds after it at the latest
        self.behind = BehindBuilds(on_idle=drop_reused_scratch, held=True)
        self.writes = BehindBuilds("zstore-ssd-write", max_bytes=MAX_WRITE_BYTES, held=True)
        starting = self.tiers.node_dir("starting") if self.tiers is not None else None
        self.hold = FirstReadHold([self.behind, self.writes], FirstReads(starting))
        self.source = ChunkSource(
            self.url,
            self.origin,
            self.tiers,
            self.fetch,
            complete=self.manifest.all_chunks_written,
            behind=self.writes,
        )
        self._layouts: dict[tuple[str, str], ArrayLayout] = {}
        self._records: dict[str, Any] = {}  # packed items' batch records, a few
        self.values: MappedValues | None = None
        self.form: ShardForm | None = None
        if self.tiers is not None and self.tiers.ram is not None:
            self.values = MappedValues(self.tiers.ram)
            kind = DecodedShards if self.tiers.ram_format == "decoded" else EncodedShards
            self.form = kind(self.url, self.tiers, self.source, self.values, self.behind)
        self._lock = self.values.lock if self.values is not None else threading.Lock()
        self._group: Any = None
        self._pid = os.getpid()
        return self

    def _choose_format(self, resolved: ResolvedCache) -> FormatChoice:
        """Settle ``ram_format`` for this store and size the tiers' admission periods."""
        tiers: TieredCache = self.tiers  # type: ignore[assignment]
        sizes = field_sizes(self.manifest, self._metas, self.fields)
        choice = choose_format(resolved, sizes.ram_bytes, sizes.stored_bytes)
        tiers.ram_format = choice.format
        # Halve the access counts every few passes over the values (see cache.admission).
        if tiers.ram is not None:
            tiers.ram.set_period(
                PASSES * (sizes.shards if choice.format == "decoded" else sizes.chunks)
            )
        if tiers.ssd is not None:
            tiers.ssd.set_period(PASSES * sizes.chunks)
        record_format(tiers.node_dir("formats"), self.manifest.store_id, choice)
        return choice

    def _fetch_mode(self, resolved: ResolvedCache | None) -> str:
        mode = resolved.fetch if resolved else "range"
        if mode != "auto":
            return mode
        # A store on NFS or Lustre costs what a remote one does: a window's chunks kept
        # as one SSD value each cost a file and an index row apiece, on the first epoch's
        # reads (measured, NFS-like model: 0.47x of no tiers against 0.83x with whole
        # shards; docs/benchmarks-notes.md).
        return "shard" if self.origin.remote and self.ssd_holds_store else "range"

    def read(
        self, item: str, spans: dict[str, Span | None], position: int | None = None
    ) -> dict[str, np.ndarray]:
        """Read ``spans`` (per field; None = the whole array) of ``item`` (at
        ``position`` in the manifest, when the caller knows it)."""
        self.open()
        with self._first_served(), self._lock:  # the unmapping thread edits the maps
            out = self._read(item, spans, position)
        self._trim()
        return out

    def warm(self, item: str, spans: dict[str, Span | None], position: int | None = None) -> int:
        """Bring ``spans`` (per field; None = the whole array) of ``item`` into the
        node's tiers as :meth:`read` would, without copying anything out
        (``zstore cache warm``): no window is assembled, chunks read around the RAM
        tier are fetched into the SSD tier but not decoded, and this thread's shard
        builds share one scratch buffer.  Returns the decoded bytes the spans cover.

        Reading whole items to warm them spent a third of a warm's CPU assembling
        arrays that were thrown away, and in fresh scratch per shard
        (docs/benchmarks-notes.md)."""
        self.open()
        with self._first_served(), self._lock:
            out, plan = self._plan(item, spans, position)
            if plan:
                with reused_scratch():
                    pieces = self._pieces(plan)  # the builds filled the tiers
                del pieces
        self._trim()
        return sum(arr.nbytes for arr in out.values()) + sum(
            math.prod(window_shape(layout, span)) * layout.dtype.itemsize
            for _, layout, span in plan
        )

    @contextlib.contextmanager
    def _first_served(self) -> Iterator[None]:
        """Start the builds held back once this read is served, or has failed, and
        no other process on the node is still on its first read (``FirstReadHold``)."""
        self.hold.begin()
        try:
            yield
        finally:
            self.hold.served()

    def start_builds(self) -> None:
        """Let this process's builds behind the reads start.  They are held until its
        first read (or batch) is served, and the first reads of the node's other
        processes (at most ``zstore.read._builds.HOLD_AT_MOST`` seconds more), so that
        a fresh job's first batches are read with no fill beside them; ``zstore cache
        warm`` starts them before its first fetch, ``settle()`` at once."""
        self.open()
        self.hold.release()

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until the shards this process is building behind its reads are in the
        RAM tier (a read that first touches a shard, or admits one that displaces
        resident ones, is served from its chunks while a background thread builds the
        shard; see ``zstore.read._builds``).  False if ``timeout`` seconds passed first."""
        if self._pid != os.getpid():
            return True
        self.hold.release()
        t0 = time.monotonic()
        if not self.writes.wait(timeout):
            return False
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
        return self.behind.wait(left)

    def _trim(self) -> None:
        """Hand the heap back once the windows read as chunks since the last time have
        decoded TRIM_AFTER bytes (their temporaries would otherwise stay with this
        process, outside the shared RAM budget), and the read buffers after a batch
        that read nothing from the origin."""
        self.origin.release_idle()
        if self.form is not None and self.form.chunk_bytes > TRIM_AFTER:
            self.form.chunk_bytes = 0
            release_free_memory()

    def _read(
        self, item: str, spans: dict[str, Span | None], position: int | None = None
    ) -> dict[str, np.ndarray]:
        found = packed_read(self, item, spans, position)
        if found is not None:  # a packed item whose shards the RAM tier holds
            return found
        out, plan = self._plan(item, spans, position)
        if plan:
            pieces = self._pieces(plan)
            for name, layout, span in plan:
                out[name] = _assemble(layout, span, pieces)
        return out

    def read_batch(
        self,
        windows: Sequence[tuple[str, dict[str, Span | None], int | None]],
        outs: list[dict[str, np.ndarray]],
        copy: Callable[[list[Callable[[], None]]], None] | None = None,
    ) -> None:
        """Read many windows into ``outs`` (one dict of arrays of the exact window shapes
        per window): the misses of all of them go to the tiers and the origin in one
        round; ``copy`` runs the copies (e.g. in a thread pool; default: in turn).  The
        copies are streamed (``zstore.streamcopy``): ``outs`` are batch slots read once
        the batch is full, not right away.  Each window is ``(item, spans, position)``,
        the position in the manifest when the caller knows it (else None)."""
        self.open()
        with self._first_served():
            self._read_batch(windows, outs, copy)

    def _read_batch(
        self,
        windows: Sequence[tuple[str, dict[str, Span | None], int | None]],
        outs: list[dict[str, np.ndarray]],
        copy: Callable[[list[Callable[[], None]]], None] | None,
    ) -> None:
        with self._lock:
            packed = packed_batch(self, windows, outs)
        if packed is not None:  # windows of packed short items, their shards mapped
            (copy or _run_all)(packed)
            return
        jobs: list[Callable[[], None]] = []
        with self._lock:
            plans = [self._plan(item, spans, position) for item, spans, position in windows]
            whole = [entry for _, plan in plans for entry in plan]
            pieces = self._pieces(whole) if whole else {}
        index = _by_path(pieces)  # a batch's windows of short items share their shards
        for (direct, plan), out in zip(plans, outs):
            for name, arr in direct.items():
                jobs.append(functools.partial(np.copyto, out[name], arr))
            for name, layout, span in plan:
                jobs.append(functools.partial(_copy_into, layout, span, index, out[name]))
        (copy or _run_all)(jobs)
        del jobs, pieces  # the fetched pieces go before the heap is trimmed
        self._trim()

    def _plan(
        self, item: str, spans: dict[str, Span | None], position: int | None = None
    ) -> tuple[dict[str, np.ndarray], list[tuple[str, ArrayLayout, Span]]]:
        """Arrays read through zarr (layouts this reader does not handle), and the plan of
        (field, layout, span) for the rest."""
        out: dict[str, np.ndarray] = {}
        plan: list[tuple[str, ArrayLayout, Span]] = []
        if self.manifest.placement is not None and position is None:
            position = self.manifest.position(item)
        for name, span in spans.items():
            layout, offset, length = self.placed(item, name, position)
            if span is not None and not 0 <= span.start <= span.stop <= length:
                raise ValueError(
                    f"{self.url}: window [{span.start}, {span.stop}) of '{item}/{name}' lies "
                    f"outside the array (length {length} along time); a window must "
                    "end within every array it reads"
                )
            if span is None and layout.fast:
                span = Span(0, length)
            if offset and span is not None:  # a packed item: a span of its pack's array
                span = Span(span.start + offset, span.stop + offset, span.pad)
            if span is None or not layout.fast or length == 0:
                out[name] = self._read_with_zarr(layout, span)
            else:
                plan.append((name, layout, span))
        return out, plan

    def _pieces(self, plan: list[tuple[str, ArrayLayout, Span]]) -> Pieces:
        """Shards (or chunks) covering every span of ``plan``."""
        if self.form is not None:
            return self.form.pieces(plan)
        return chunk_pieces(self.source, plan, ram=self.tiers is not None)

    def _read_with_zarr(self, layout: ArrayLayout, span: Span | None) -> np.ndarray:
        """Fallback: zarr's own indexing on the cached store."""
        if self._group is None:
            import zarr

            store = CachedStore(
                self.url,
                store_id=self.manifest.store_id,
                cache=self.cache,
                storage_options=self.storage_options,
                complete=self.manifest.all_chunks_written,
            )
            self._group = zarr.open_group(store, mode="r")
        arr = self._group[layout.path]
        if span is None:
            return np.asarray(arr[...])
        index = [slice(None)] * len(layout.shape)
        index[layout.time_axis] = slice(span.start, span.stop)
        data = np.asarray(arr[tuple(index)])
        if span.pad:
            widths = [(0, 0)] * data.ndim
            widths[layout.time_axis] = (0, span.pad)
            data = np.pad(data, widths)
        return data


def _run_all(jobs: list[Callable[[], None]]) -> None:
    for job in jobs:
        job()


def _copy_into(layout: ArrayLayout, span: Span, index: PathIndex, out: np.ndarray) -> None:
    """One window's copy into its batch slot (a job of :meth:`WindowReader.read_batch`)."""
    _assemble(layout, span, _near(index, layout.path, span), out, stream=True)


#: per value path: its pieces' offsets (sorted), the pieces, and the longest's length
PathIndex = dict[str, tuple[list[int], list[tuple[int, Any]], int]]


def _by_path(pieces: Pieces) -> PathIndex:
    """A batch's pieces by value path, in offset order: each window then looks at the
    few that can overlap it, not at every piece of the batch."""
    by: dict[str, list[tuple[int, Any]]] = {}
    for (path, _), (offset, arr) in pieces.items():
        by.setdefault(path, []).append((offset, arr))
    out: PathIndex = {}
    for path, entries in by.items():
        entries.sort(key=lambda e: e[0])
        longest = max(max(arr.shape, default=0) for _, arr in entries)  # >= along time
        out[path] = ([o for o, _ in entries], entries, longest)
    return out


def _near(index: PathIndex, path: str, span: Span) -> Pieces:
    """The pieces of ``path`` that can overlap ``span`` (as a :data:`Pieces` dict)."""
    found = index.get(path)
    if found is None:
        return {}
    offsets, entries, longest = found
    lo = bisect.bisect_left(offsets, span.start - longest)
    hi = bisect.bisect_left(offsets, span.stop)
    return {(path, k): entries[k] for k in range(lo, hi)}


def window_shape(layout: ArrayLayout, span: Span) -> tuple[int, ...]:
    """The shape of ``span`` of an array: its own, with the window's length along time."""
    shape = list(layout.shape)
    shape[layout.time_axis] = span.stop - span.start + span.pad
    return tuple(shape)


def _assemble(
    layout: ArrayLayout,
    span: Span,
    pieces: Pieces,
    out: np.ndarray | None = None,
    stream: bool = False,
) -> np.ndarray:
    """One copy of ``span`` out of the pieces (chunks or shards) that cover it, into
    ``out`` when given (it must have the window's shape and the array's dtype); with
    ``stream`` the copy bypasses the CPU's cache (for a batch slot read later)."""
    axis = layout.time_axis
    shape = window_shape(layout, span)
    if out is None:
        out = np.empty(shape, dtype=layout.dtype)
    elif out.shape != shape or out.dtype != layout.dtype:
        raise ValueError(
            f"'{layout.path}': a window of shape {tuple(shape)} ({layout.dtype}) "
            f"does not fit the batch slot of shape {out.shape} ({out.dtype}); "
            "items of a batch need the same shape apart from time"
        )
    dst = [slice(None)] * len(shape)
    src = [slice(None)] * len(shape)
    parts: list[tuple[int, int]] = []
    for (path, _), (offset, arr) in pieces.items():
        if path != layout.path:
            continue
        lo = max(span.start, offset)
        hi = min(span.stop, offset + arr.shape[axis])
        if lo >= hi:
            continue
        dst[axis] = slice(lo - span.start, hi - span.start)
        src[axis] = slice(lo - offset, hi - offset)
        if isinstance(arr, Lazy):
            arr = arr.decoded()
        copy_values(out[tuple(dst)], arr[tuple(src)], stream=stream)
        parts.append((lo, hi))
    covered = _covered(parts)
    if covered != span.stop - span.start:  # never hand out np.empty's leftover memory
        raise IntegrityError(
            f"'{layout.path}': the pieces read cover {covered} of the "
            f"{span.stop - span.start} samples of window [{span.start}, "
            f"{span.stop}); this is a bug in zstore, please report it"
        )
    if span.pad:
        dst[axis] = slice(span.stop - span.start, None)
        out[tuple(dst)] = 0
    return out


def _covered(parts: list[tuple[int, int]]) -> int:
    """Samples in the union of ``[lo, hi)`` intervals (pieces of one value may overlap:
    a shard mapped for one window of a batch and its chunks read for another)."""
    total, end = 0, None
    for lo, hi in sorted(parts):
        if end is not None and lo < end:
            lo = end
        if hi > lo:
            total += hi - lo
        end = hi if end is None else max(end, hi)
    return total
