"""Decoding the bytes ``zstore convert`` writes, without zarr's async machinery.

Handles the codec chains :func:`zstore.format.layout.parse_array_meta` marks as fast:
``bytes`` (little endian) followed by any of blosc, zstd and crc32c, plus the
sharding index (``bytes`` + optional ``crc32c``).
"""

from __future__ import annotations

import numcodecs.blosc
import numcodecs.zstd
import numpy as np
from crc32c import crc32c

from zstore.errors import IntegrityError
from zstore.format.layout import ArrayLayout

EMPTY = np.uint64(2**64 - 1)


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
    try:
        if out is None:
            return numcodecs.blosc.decompress(buf)
        head = memoryview(buf)[:16]  # blosc's header: nbytes is a uint32 at offset 4
        size = int.from_bytes(head[4:8], "little") if len(head) == 16 else -1
        if size != expected:
            raise IntegrityError(f"{where}: decodes to {size} bytes, expected {expected}")
        target = out.data.cast("B")[:expected]
        numcodecs.blosc.decompress(buf, target)
        return target
    except (RuntimeError, ValueError) as e:  # bytes blosc cannot read
        raise IntegrityError(f"{where}: blosc cannot decode the bytes ({e})") from None


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
