"""Slotted values: RAM-tier values written in place, one slot at a time, after they are
indexed (``Tier.reserve``), and read in place by every process that maps them.

The payload (after the value's 64-byte header, :mod:`zstore.cache.value`):

- one presence byte per slot: 1 once the slot's bytes and its crc32c are written;
- one crc32c per slot (little-endian u32), from the next 8-byte boundary;
- the data, from the file's next page boundary: ``data_nbytes`` bytes, in which each
  slot is a list of byte ranges its writer and readers agree on (the caller's layout:
  a chunk of a decoded shard is a range per row of the shard).

A writer writes a slot's ranges, then its crc (over the ranges in order), then its
presence byte, each with ``pwrite`` on the value's file: a writer killed between them
leaves the slot absent.  Writers of one slot write the same bytes (what it holds is
decided by the key), so two at once are harmless.  A reader uses a slot only once its
presence byte is set and its bytes match their crc (checked once per process; a slot
this process wrote itself is trusted).  A file evicted while a process still writes
into it is unlinked: the process's writes then fail to open it and are dropped, and a
process that mapped it keeps reading the slots it holds until it unmaps it.

Slots not written yet stay holes of the sparse file: the pages of the presence bytes
and crcs are the only ones a reader touches before a slot is present, so a value takes
memory as its slots are written, though its whole size counts against the budget.
Writes go through ``pwrite``, never a writable map: a full tmpfs fails the write (the
slot stays absent) instead of killing the process with SIGBUS.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

import numpy as np
from crc32c import crc32c

from zstore.cache.value import HEADER_SIZE

PAGE = 4096
_CRC = struct.Struct("<I")
#: a slot's byte ranges in the data: (offset, length)
Ranges = Sequence[tuple[int, int]]


def _offsets(n: int, data_nbytes: int) -> tuple[int, int, int]:
    """(crc offset, data offset, payload size) of ``n`` slots over ``data_nbytes`` of
    data, as offsets in the payload (the file's offsets less its header)."""
    crc_at = -(-n // 8) * 8
    data_at = -(-(HEADER_SIZE + crc_at + 4 * n) // PAGE) * PAGE - HEADER_SIZE
    return crc_at, data_at, data_at + data_nbytes


def data_nbytes_of(n: int, payload_nbytes: int) -> int:
    """The data bytes of a slotted value of ``n`` slots whose payload is
    ``payload_nbytes`` (negative when it cannot be one)."""
    return payload_nbytes - _offsets(n, 0)[1]


def slots_nbytes(n: int, data_nbytes: int) -> int:
    """The payload size of a slotted value of ``n`` slots over ``data_nbytes`` of data."""
    return _offsets(n, data_nbytes)[2]


class Slots:
    """A mapped slotted value of ``n`` slots over ``data_nbytes`` (its ``payload``, as
    ``Checked.payload`` of a mapped value gives it), whose file is at ``path``."""

    def __init__(
        self,
        payload: memoryview,
        n: int,
        data_nbytes: int,
        path: str = "",
    ):
        crc_at, data_at, nbytes = _offsets(n, data_nbytes)
        if len(payload) != nbytes:
            raise ValueError(
                f"a slotted value of {n} slots takes {nbytes} bytes, not {len(payload)}"
            )
        self.n, self.path = n, path
        self._data_at, self._crc_at = data_at, crc_at
        #: the data, in the map (read a slot's ranges only once :meth:`has` said so)
        self.data = payload[data_at:]
        self.present = np.frombuffer(payload, dtype=np.uint8, count=n)
        self.crcs = np.frombuffer(payload, dtype="<u4", count=n, offset=crc_at)
        self.checked = np.zeros(n, dtype=bool)  # slots this process checked or wrote

    def has(self, j: int, ranges: Ranges) -> bool:
        """Whether slot ``j`` (its ``ranges`` of the data) is written and matches its
        crc (checked once per process).  A slot that fails its check reads as absent:
        it is written again."""
        if self.checked[j]:
            return True
        if not self.present[j]:
            return False
        crc = 0
        for offset, length in ranges:
            crc = crc32c(self.data[offset : offset + length], crc)
        if crc != int(self.crcs[j]):
            return False
        self.checked[j] = True
        return True

    def all_checked(self, first: int, stop: int) -> bool:
        """Whether slots ``first`` to ``stop - 1`` were all checked by :meth:`has`."""
        return bool(self.checked[first:stop].all())

    def write(self, j: int, parts: Sequence[tuple[int, memoryview]], crc: int) -> bool:
        """Write slot ``j``: each (offset in the data, bytes) of ``parts``, then ``crc``
        (the crc32c of the parts' bytes in order: the caller takes it in one call over a
        contiguous copy of them, cheaper than one per part), then its presence byte;
        False when the value's file is gone (evicted) or a write fails (a full tmpfs):
        the slot then stays absent."""
        try:
            fd = os.open(self.path, os.O_WRONLY)
        except OSError:
            return False
        try:
            at = HEADER_SIZE + self._data_at
            for offset, data in parts:
                if os.pwrite(fd, data, at + offset) != len(data):
                    return False
            os.pwrite(fd, _CRC.pack(crc), HEADER_SIZE + self._crc_at + 4 * j)
            os.pwrite(fd, b"\x01", HEADER_SIZE + j)
        except OSError:
            return False
        finally:
            os.close(fd)
        self.checked[j] = True
        return True
