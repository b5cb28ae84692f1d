"""The format of a cached value: a 64-byte header (magic, flags, length, crc32c), then the
payload, 64-byte aligned so decoded arrays map zero-copy.

A *blocked* value (flag 1) carries one crc32c per 128 KiB block of its payload, and the
header's crc covers that table.  A process that maps a large decoded shard then checks
only the blocks it reads, the first time it reads them, instead of the whole value.

A *slotted* value (flag 2) is written in place after it is indexed: a file of its full
size, sparse until its slots are written one by one, each with its own crc32c and a
presence byte (:mod:`zstore.cache.slots`).  Its header's crc covers the flags and the
length only; its payload is checked slot by slot, never whole.
"""

from __future__ import annotations

import io
import mmap
import struct
from typing import Any

import numpy as np
from crc32c import crc32c

MAGIC = b"ZSV1"
HEADER = struct.Struct("<4sIQI")  # magic, flags, payload length, crc32c
HEADER_SIZE = 64
BLOCKED = 1
SLOTTED = 2
BLOCK = 128 * 1024


def _align(n: int) -> int:
    return -(-n // HEADER_SIZE) * HEADER_SIZE


def header_size(nbytes: int, *, blocked: bool = False) -> int:
    """Bytes that :func:`header` puts before a payload of ``nbytes``."""
    return _align(HEADER_SIZE + 4 * -(-nbytes // BLOCK)) if blocked else HEADER_SIZE


def header(payload: bytes | memoryview, *, blocked: bool = False) -> bytes:
    """Everything that precedes ``payload`` in the stored value."""
    if not blocked:
        head = HEADER.pack(MAGIC, 0, len(payload), crc32c(payload))
        return head + bytes(HEADER_SIZE - HEADER.size)
    table = np.array(
        [crc32c(payload[i : i + BLOCK]) for i in range(0, len(payload), BLOCK)], dtype="<u4"
    ).tobytes()
    head = HEADER.pack(MAGIC, BLOCKED, len(payload), crc32c(table))
    start = HEADER_SIZE + len(table)
    return head + bytes(HEADER_SIZE - HEADER.size) + table + bytes(_align(start) - start)


def slotted_header(nbytes: int) -> bytes:
    """The header of a slotted value of ``nbytes`` (see :mod:`zstore.cache.slots`)."""
    crc = crc32c(struct.pack("<IQ", SLOTTED, nbytes))
    return HEADER.pack(MAGIC, SLOTTED, nbytes, crc) + bytes(HEADER_SIZE - HEADER.size)


class Parts(io.RawIOBase):
    """A file-like reader over header + payload, so large values are written without
    first being joined into one more copy in memory."""

    def __init__(self, *parts: bytes | memoryview):
        self._parts = [memoryview(p).cast("B") for p in parts if len(p)]

    def read(self, n: int = -1) -> bytes | memoryview:
        if not self._parts:
            return b""
        part = self._parts[0]
        n = len(part) if n is None or n < 0 else n
        out, self._parts[0] = part[:n], part[n:]
        if not len(self._parts[0]):
            self._parts.pop(0)
        return out


class Checked:
    """A value's payload with lazy block checks (``verify``); non-blocked values are
    checked whole when opened."""

    def __init__(
        self,
        payload: memoryview,
        table: np.ndarray | None,
        mapped: mmap.mmap | None = None,
        offset: int = 0,
    ):
        self.payload = payload
        self._table = table
        self._done = None if table is None else np.zeros(len(table), dtype=bool)
        self.complete = table is None
        self._map, self._offset = mapped, offset  # the payload's map and where it starts
        #: a slotted value: checked slot by slot by its reader (zstore.cache.slots)
        self.slotted = False

    def prefetch(self, start: int, stop: int) -> None:
        """Ask the kernel to read payload bytes [start, stop) of a mapped value in now,
        when some of their blocks are unchecked (not read yet in this process).

        An SSD-tier value written around the page cache (``zstore.cache._direct``) is
        otherwise read from the device page fault by page fault as it is checked and
        decoded: 600 KB of a whole shard took ~6 ms that way on this project's test
        machine, ~1 ms after one ``MADV_WILLNEED`` over the range
        (docs/benchmarks-notes.md)."""
        if self._map is None or stop <= start or self.complete:
            return
        first, last = start // BLOCK, (stop - 1) // BLOCK + 1
        if self._done[first:last].all():  # type: ignore[index]
            return
        lo = (self._offset + start) // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            self._map.madvise(mmap.MADV_WILLNEED, lo, self._offset + stop - lo)
        except (OSError, ValueError, AttributeError):  # advice only
            pass

    def verify(self, start: int, stop: int) -> bool:
        """Check the blocks of payload bytes [start, stop) not checked yet."""
        if self.complete or stop <= start:
            return True
        first, last = start // BLOCK, (stop - 1) // BLOCK + 1
        done = self._done
        if done[first:last].all():  # type: ignore[index]
            return True
        for b in range(first, last):
            if not done[b]:  # type: ignore[index]
                if crc32c(self.payload[b * BLOCK : (b + 1) * BLOCK]) != self._table[b]:  # type: ignore
                    return False
                done[b] = True  # type: ignore[index]
        self.complete = bool(done.all())  # type: ignore[union-attr]
        return True


def open_value(value: Any) -> Checked | None:
    """Parse a stored value; None when its header, length or (non-blocked) crc is wrong."""
    if len(value) < HEADER_SIZE:
        return None
    magic, flags, length, crc = HEADER.unpack_from(value)
    if magic != MAGIC:
        return None
    view = memoryview(value)
    if flags == SLOTTED:
        payload = view[HEADER_SIZE:]
        if len(payload) != length or crc32c(struct.pack("<IQ", flags, length)) != crc:
            return None
        checked = Checked(payload, None)
        checked.slotted = True
        return checked
    if not flags & BLOCKED:
        payload = view[HEADER_SIZE:]
        if len(payload) != length or crc32c(payload) != crc:
            return None
        return Checked(payload, None)
    n = -(-length // BLOCK)
    table_bytes = view[HEADER_SIZE : HEADER_SIZE + 4 * n]
    start = _align(HEADER_SIZE + 4 * n)
    payload = view[start:]
    if len(table_bytes) != 4 * n or len(payload) != length or crc32c(table_bytes) != crc:
        return None
    mapped = value if isinstance(value, mmap.mmap) else None
    return Checked(payload, np.frombuffer(table_bytes, dtype="<u4"), mapped, start)
