"""What windows are read from: pieces of shards and chunks, and the scratch memory that
decoding and building shards use (:mod:`zstore.read._ram_shards` and its builds).

A piece is a decoded array, or a :class:`Lazy` chunk decoded when the window is copied
out of it; :func:`chunk_pieces` reads a plan's chunks from the tiers or the origin.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np

from zstore.format import ArrayLayout, Span
from zstore.read._chunks import ChunkSource
from zstore.read.streamcopy import narrow

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


def in_shard(layout: ArrayLayout, s: int, span: Span) -> Span:
    """The part of ``span`` that lies in shard ``s``."""
    return Span(max(span.start, s * layout.shard), min(span.stop, (s + 1) * layout.shard))


def shard_shape(layout: ArrayLayout, s: int) -> tuple[int, ...]:
    shape = list(layout.shape)
    shape[layout.time_axis] = min(layout.shard, layout.length - s * layout.shard)
    return tuple(shape)


def copy_time(dst: np.ndarray, offset: int, src: np.ndarray, axis: int) -> bool:
    """Copy ``src`` into ``dst`` at ``offset`` along ``axis``, clipped to ``dst``; a
    float chunk of int16 samples into an int16 shard is narrowed (``streamcopy.narrow``):
    False, ``dst``'s part unfinished, when one of its values is not a sample."""
    n = min(src.shape[axis], dst.shape[axis] - offset)
    d = [slice(None)] * dst.ndim
    s = [slice(None)] * dst.ndim
    d[axis], s[axis] = slice(offset, offset + n), slice(0, n)
    if dst.dtype != src.dtype:
        return narrow(dst[tuple(d)], src[tuple(s)])
    dst[tuple(d)] = src[tuple(s)]
    return True


def scratch(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
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
    if REUSE.on:  # the builder thread: one mapping, kept while builds are queued
        if REUSE.buf is None or len(REUSE.buf) < nbytes:
            REUSE.buf = None
            REUSE.buf = mmap.mmap(-1, nbytes)
        buf = REUSE.buf
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


REUSE = _Reused()


def drop_reused_scratch() -> None:
    REUSE.buf = None


@contextlib.contextmanager
def reused_scratch() -> Iterator[None]:
    """This thread's shard builds share one scratch mapping, as the builder thread's
    do: for a caller that drops the pieces a build returns (``zstore cache warm``),
    since the next build overwrites them.  A fresh mapping per shard page-faulted its
    whole size in: copying chunks into it took 0.30 s of a 1.44 s single-thread warm of
    480 MB (docs/benchmarks-notes.md)."""
    was, REUSE.on = REUSE.on, True
    try:
        yield
    finally:
        REUSE.on = was


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
