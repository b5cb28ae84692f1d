"""Decoding the bytes ``zstore convert`` writes, without zarr's async machinery.

Handles the codec chains :func:`zstore.format.layout.parse_array_meta` marks as fast:
``bytes`` (little endian) followed by any of blosc, zstd and crc32c, plus the
sharding index (``bytes`` + optional ``crc32c``).

Blosc chunks are decoded by python-blosc (the ``blosc`` package) where it is installed,
else by numcodecs.  Both hold the same c-blosc 1.21, but numcodecs' wheels are built
without AVX2 (``-mno-avx2``), so its bitshuffle runs the SSE2 kernels, where python-blosc
picks AVX2 at run time: a 512 KB chunk of lz4 + bitshuffle audio decodes in ~105 us
against ~155 (docs/benchmarks-notes.md, "Decoding with AVX2").  The bytes written stay
numcodecs' (they are zarr's, and python-blosc's zstd writes other bytes).  Importing
this module sets python-blosc to one thread per call and to release the GIL while it
decodes: zstore decodes in several threads of its own.
"""

from __future__ import annotations

import importlib
from typing import Any

import numcodecs.blosc
import numcodecs.zstd
import numpy as np
from crc32c import crc32c

from zstore.errors import IntegrityError
from zstore.format.layout import ArrayLayout

EMPTY = np.uint64(2**64 - 1)

_blosc: Any
try:
    _blosc = importlib.import_module("blosc")
except ImportError:  # numcodecs decodes (SSE2 bitshuffle: ~1.5x the time)
    _blosc = None
    _BLOSC_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, ValueError)
else:
    _blosc.set_nthreads(1)  # each of zstore's decoding threads decodes one chunk
    _blosc.set_releasegil(True)  # ... beside the others
    _BLOSC_ERRORS = (RuntimeError, ValueError, _blosc.blosc_extension.error)


def strip_crc(buf: memoryview, where: str) -> memoryview:
    """The bytes before a trailing crc32c, after checking it."""
    if len(buf) < 4:
        raise IntegrityError(f"{where}: {len(buf)} bytes, too short for its crc32c")
    body = buf[:-4]
    if crc32c(body) != int.from_bytes(buf[-4:], "little"):
        raise IntegrityError(f"{where}: crc32c mismatch: the bytes are corrupt")
    return body


def decode_chunk(
    layout: ArrayLayout, data: bytes | memoryview, where: str, out: np.ndarray | None = None
) -> np.ndarray:
    """Decode one inner chunk to an array of ``layout.chunk_shape``; into ``out`` (a
    buffer of at least ``layout.chunk_nbytes``, reused by the caller) when the last
    codec is blosc, which saves an allocation and keeps the bytes in cache."""
    buf: bytes | memoryview = memoryview(data)
    expected = layout.chunk_nbytes
    for i in range(len(layout.codecs) - 1, -1, -1):
        name = layout.codecs[i]["name"]
        if name == "crc32c":
            buf = strip_crc(memoryview(buf), where)
        elif name == "blosc":
            buf = _unblosc(buf, out if i == 0 else None, expected, where)
        elif name == "zstd":
            buf = numcodecs.zstd.decompress(buf)
        else:
            raise IntegrityError(f"{where}: codec {name!r} is not decodable here")
    if len(buf) != expected:
        raise IntegrityError(f"{where}: decoded {len(buf)} bytes, expected {expected}")
    return np.frombuffer(buf, dtype=layout.dtype).reshape(layout.chunk_shape)


def _unblosc(
    buf: bytes | memoryview, out: np.ndarray | None, expected: int, where: str
) -> bytes | memoryview:
    if out is None:
        try:
            return (_blosc or numcodecs.blosc).decompress(buf)
        except _BLOSC_ERRORS as e:  # bytes blosc cannot read
            raise IntegrityError(f"{where}: blosc cannot decode the bytes ({e})") from None
    head = memoryview(buf)[:16]  # blosc's header: nbytes is a uint32 at offset 4
    size = int.from_bytes(head[4:8], "little") if len(head) == 16 else -1
    if size != expected:
        raise IntegrityError(f"{where}: decodes to {size} bytes, expected {expected}")
    target = out.data.cast("B")[:expected]  # C-contiguous, or this raises
    if len(target) < expected:  # never decode past the caller's buffer
        raise ValueError(f"a buffer of {out.nbytes} bytes for a chunk of {expected}")
    try:
        if _blosc is None:
            numcodecs.blosc.decompress(buf, target)
        else:  # writes the header's nbytes: the buffer's size, checked above
            _blosc.decompress_ptr(buf, out.ctypes.data)
    except _BLOSC_ERRORS as e:
        raise IntegrityError(f"{where}: blosc cannot decode the bytes ({e})") from None
    return target


def decode_index(layout: ArrayLayout, data: bytes | memoryview, where: str) -> np.ndarray:
    """Decode a shard index to an (n, 2) array of (offset, nbytes); EMPTY marks a missing chunk."""
    buf = memoryview(data)
    if len(buf) != layout.index_bytes:
        raise IntegrityError(
            f"{where}: shard index has {len(buf)} bytes, expected {layout.index_bytes}"
        )
    if any(c["name"] == "crc32c" for c in layout.index_codecs):
        buf = strip_crc(buf, where)
    return np.frombuffer(buf, dtype="<u8").reshape(-1, 2)


def fill_chunk(layout: ArrayLayout) -> np.ndarray:
    """A chunk of the fill value (for chunks the store never wrote)."""
    return np.full(layout.chunk_shape, layout.fill_value or 0, dtype=layout.dtype)
