"""Reused memory for the byte ranges read from a store on a local or network file system.

A window's chunks are read as ranges of their shard, each into new memory: ~2.8 MB of
encoded bytes per 10 s window of 8 channels, freed once the window is decoded.  glibc
hands a freed batch's worth (tens of MB) back to the OS, so every batch page-faulted its
reads into fresh, zeroed pages again: ~90,000 faults (~360 MB) per epoch of 128 windows,
each epoch, wherever windows are read from chunks (no RAM tier, data beyond the RAM
budget, the first epoch).  :class:`Slabs` keeps a few MB-sized buffers and places the
ranges in them; a slab is reused once no view of it is left (a piece not yet decoded, a
fill holding its chunks), so memory that something still reads is never overwritten.

:func:`small_page_array` gives long-lived, large arrays (a loader's batch buffers) memory
in small pages: numpy asks for huge pages for arrays of 4 MB and more, and where a
virtual machine hands free 2 MB blocks back to its host, those are what a huge-page
fault takes, at 1-3 s of kernel time for a few hundred MB.

May import: numpy.
"""

from __future__ import annotations

import math
import mmap
import sys
import threading

import numpy as np

#: Bytes per slab; a range larger than this is read into memory of its own.
SLAB_BYTES = 4 * 2**20
#: Slabs kept per process, free or in use (their bytes are the process's to keep);
#: past that a range gets memory of its own, freed with it, as before.  Measured (one
#: process, no RAM tier, 128 windows an epoch): 16 MB still faulted ~60,000 pages an
#: epoch, 32 MB ~25,000, 64 MB ~1,000 (epochs 0.40 s against 0.54 s before); 128 MB
#: was no faster and kept ~20 MB more.
KEEP_BYTES = 64 * 2**20
#: Reads in a row with no range read after which the kept slabs are dropped.  After
#: one, a first epoch with a RAM tier filled by its reads (``ram_format="chunks"``),
#: whose windows now and then find every chunk in the tier, dropped them every few
#: windows and faulted them in again: ~26,000 more page faults (~0.1 s of kernel
#: time) in an epoch of 128 windows (docs/benchmarks-notes.md).
IDLE_READS = 16


class Slabs:
    """Views of reused buffers to read byte ranges into (thread safe)."""

    def __init__(self, slab_bytes: int | None = None, keep_bytes: int | None = None):
        """``slab_bytes`` and ``keep_bytes`` default to the module's SLAB_BYTES and
        KEEP_BYTES as they are when the slabs are made."""
        self.slab_bytes = SLAB_BYTES if slab_bytes is None else slab_bytes
        self.keep = max(1, (KEEP_BYTES if keep_bytes is None else keep_bytes) // self.slab_bytes)
        self._slabs: list[mmap.mmap] = []
        self._current = -1  # index of the slab being filled
        self._used = 0  # bytes of it handed out
        self._takes = 0  # views handed out since the last release_idle
        self._idle = 0  # release_idle calls in a row with no view handed out
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview | None:
        """A writable view of ``nbytes`` for one read, or None when it is larger than a
        slab (read it into memory of its own)."""
        if nbytes > self.slab_bytes or nbytes <= 0:
            return None
        with self._lock:
            self._takes += 1
            if self._current < 0 or self._used + nbytes > self.slab_bytes:
                self._current, self._used = self._next(), 0
            if self._current < 0:  # every kept slab is in use
                return np.empty(nbytes, dtype=np.uint8).data
            start = self._used
            self._used += nbytes
            return memoryview(self._slabs[self._current])[start : start + nbytes]

    def _next(self) -> int:
        """A slab no view refers to any more (a new one while fewer than ``keep``
        exist); -1 when all are in use."""
        for i in range(len(self._slabs)):
            # references: the list's and getrefcount's own; a view adds its buffer's
            if i != self._current and sys.getrefcount(self._slabs[i]) <= 2:
                return i
        if len(self._slabs) < self.keep:
            self._slabs.append(_small_pages(self.slab_bytes))
            return len(self._slabs) - 1
        return -1

    def release_idle(self) -> None:
        """Drop the kept slabs when no range was read since the last IDLE_READS calls (a
        reader whose windows all come from the RAM tier keeps no read buffers)."""
        with self._lock:
            self._idle = 0 if self._takes else self._idle + 1
            if self._idle >= IDLE_READS and self._slabs:
                self._slabs, self._current, self._used = [], -1, 0
            self._takes = 0

    def in_use(self) -> int:
        """Slabs that some view still refers to (for tests)."""
        with self._lock:
            return sum(sys.getrefcount(self._slabs[i]) > 2 for i in range(len(self._slabs)))


def small_page_array(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised array of ``shape`` in an anonymous mapping of its own, in small
    pages (``MADV_NOHUGEPAGE``), unmapped when the array and its views are freed.

    For large arrays kept and reused, such as a loader's batch buffers.  ``np.empty``
    asks the kernel for huge pages from 4 MB up; on a virtual machine that reports free
    memory to its host (free page reporting works in 2 MB blocks), a huge-page fault
    takes a block the host has taken back.  Measured (4 ranks, WindowLoader, 80 MB batch
    buffers): epochs 0 and 1 spent 2-7 s of kernel time on them in most runs, against
    0.1-0.45 s in small pages (docs/benchmarks-notes.md, "Batch buffers in small pages").
    """
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes == 0:  # a mapping cannot be empty
        return np.empty(shape, dtype=dtype)
    # made on the mapping itself, so that its views refer to this array (a loader tells
    # a buffer still held from its references)
    return np.ndarray(shape, dtype=dtype, buffer=_small_pages(nbytes))


def _small_pages(nbytes: int) -> mmap.mmap:
    """An anonymous mapping of ``nbytes`` in small pages (numpy's large arrays ask for
    huge pages: see :func:`small_page_array`), and private: a forked child gets a copy,
    as of the heap."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; elsewhere small pages are the default
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return buf
