"""Decoding the bytes ``zstore convert`` writes, without zarr's async machinery.

Handles the codec chains :func:`zstore.layout.parse_array_meta` marks as fast:
``bytes`` (little endian) followed by any of blosc, zstd and crc32c, plus the
sharding index (``bytes`` + optional ``crc32c``).
"""

from __future__ import annotations

import numcodecs.blosc
import numcodecs.zstd
import numpy as np
from crc32c import crc32c

from zstore.errors import IntegrityError
from zstore.layout import ArrayLayout

EMPTY = np.uint64(2**64 - 1)


def strip_crc(buf: memoryview, where: str) -> memoryview:
    """The bytes before a trailing crc32c, after checking it."""
    if len(buf) < 4:
        raise IntegrityError(f"{where}: {len(buf)} bytes, too short for its crc32c")
    body = buf[:-4]
    if crc32c(body) != int.from_bytes(buf[-4:], "little"):
        raise IntegrityError(f"{where}: crc32c mismatch: the bytes are corrupt")
    return body


def decode_chunk(layout: ArrayLayout, data: bytes | memoryview, where: str) -> np.ndarray:
    """Decode one inner chunk to an array of ``layout.chunk_shape``."""
    buf: bytes | memoryview = memoryview(data)
    for codec in reversed(layout.codecs):
        name = codec["name"]
        if name == "crc32c":
            buf = strip_crc(memoryview(buf), where)
        elif name == "blosc":
            buf = numcodecs.blosc.decompress(buf)
        elif name == "zstd":
            buf = numcodecs.zstd.decompress(buf)
        else:
            raise IntegrityError(f"{where}: codec {name!r} is not decodable here")
    expected = layout.chunk_nbytes
    if len(buf) != expected:
        raise IntegrityError(f"{where}: decoded {len(buf)} bytes, expected {expected}")
    return np.frombuffer(buf, dtype=layout.dtype).reshape(layout.chunk_shape)


def decode_index(layout: ArrayLayout, data: bytes | memoryview, where: str) -> np.ndarray:
    """Decode a shard index to an (n, 2) array of (offset, nbytes); EMPTY marks a missing chunk."""
    buf = memoryview(data)
    if len(buf) != layout.index_bytes:
        raise IntegrityError(f"{where}: shard index has {len(buf)} bytes, "
                             f"expected {layout.index_bytes}")
    if any(c["name"] == "crc32c" for c in layout.index_codecs):
        buf = strip_crc(buf, where)
    return np.frombuffer(buf, dtype="<u8").reshape(-1, 2)


def fill_chunk(layout: ArrayLayout) -> np.ndarray:
    """A chunk of the fill value (for chunks the store never wrote)."""
    return np.full(layout.chunk_shape, layout.fill_value or 0, dtype=layout.dtype)
