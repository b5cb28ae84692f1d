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

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from zstore.format import (
    ArrayLayout,
    Span,
    cache_namespace,
)
from zstore.read import _window_copy as copies
from zstore.read._packed_batch import packed_batch, packed_read
from zstore.read._reader_open import ReaderSetup
from zstore.read._shard_pieces import (
    TRIM_AFTER,
    Pieces,
    chunk_pieces,
    release_free_memory,
    reused_scratch,
)
from zstore.read._zarr_store import CachedStore

#: arrays stored whole of at most this many bytes that zarr reads (scalars, which the
#: reader does not handle itself) are kept once read, up to MAX_SMALL of them
SMALL_BYTES, MAX_SMALL = 4096, 65536


class WindowReader(ReaderSetup):
    """Reads windows of a zstore store.  Opens lazily, once per process (see
    :class:`zstore.read._reader_open.ReaderSetup`); pickles small."""

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
            math.prod(copies.window_shape(layout, span)) * layout.dtype.itemsize
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
        end = None if timeout is None else time.monotonic() + timeout
        for queue in (self.writes, self.fill_process, self.behind):
            left = None if end is None else max(0.0, end - time.monotonic())
            if queue is not None and not queue.wait(left):
                return False
        return True

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
                out[name] = copies.assemble(layout, span, pieces)
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
            (copy or copies.run_all)(packed)
            return
        jobs: list[Callable[[], None]] = []
        with self._lock:
            plans = [self._plan(item, spans, position) for item, spans, position in windows]
            whole = [entry for _, plan in plans for entry in plan]
            pieces = self._pieces(whole) if whole else {}
        index = copies.by_path(pieces)  # a batch's windows of short items share their shards
        for (direct, plan), out in zip(plans, outs):
            for name, arr in direct.items():
                jobs.append(functools.partial(np.copyto, out[name], arr))
            for name, layout, span in plan:
                jobs.append(functools.partial(copies.copy_into, layout, span, index, out[name]))
        (copy or copies.run_all)(jobs)
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
            if self.in_record(position, name):  # a packed item's array stored whole
                out[name] = self.records.array(position, name).copy()  # type: ignore[arg-type]
                continue
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
        small = span is None and layout.dtype.itemsize * math.prod(layout.shape) <= SMALL_BYTES
        if small:  # a scalar label, read with every window of its item: kept
            kept = self._small.get(layout.path)
            if kept is not None:
                return kept.copy()
        if self._group is None:
            import zarr

            store = CachedStore(
                self.url,
                store_id=self.manifest.store_id,
                namespace=cache_namespace(self.manifest.store_id, self.manifest.extra),
                cache=self.cache,
                storage_options=self.storage_options,
                complete=self.manifest.all_chunks_written,
            )
            self._group = zarr.open_group(store, mode="r")
        arr = self._group[layout.path]
        if span is None:
            value = np.asarray(arr[...])
            self.check_root()  # values read past the checked chunk rounds
            if small:
                if len(self._small) >= MAX_SMALL:
                    self._small.clear()
                self._small[layout.path] = value.copy()
            return value
        index = [slice(None)] * len(layout.shape)
        index[layout.time_axis] = slice(span.start, span.stop)
        data = np.asarray(arr[tuple(index)])
        self.check_root()
        if span.pad:
            widths = [(0, 0)] * data.ndim
            widths[layout.time_axis] = (0, span.pad)
            data = np.pad(data, widths)
        return data
