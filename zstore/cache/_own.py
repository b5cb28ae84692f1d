"""The RAM tier's values this tier object wrote itself, which it maps without checking
their blocks again.

A blocked value's crc32c per 128 KiB block guards a reader against a file it did not
write: a killed or faulty writer, a damaged disk, another program.  The process that
wrote a RAM-tier value computed those checksums from the very bytes it wrote, moments
before, into tmpfs, which is memory like its own heap.  Checking them again on its own
reads was ~230 MB of one rank's first epoch on a cold NFS-like origin, in its reading
thread: every block of every shard its fill had just written (~0.02-0.04 s; alone,
within the run-to-run spread of that epoch: docs/benchmarks-notes.md).  Every other
process, and every other tier object in this one (a fresh reader), still checks each
block the first time it reads it.

A value is known by its key, inode and change time: a file evicted and replaced under
the same key, even one given the same inode number, is not taken for the one written.
"""

from __future__ import annotations

import os

MAX_OWN = 1 << 16  # values remembered (a dict of short keys), then forgotten all at once


class OwnWrites:
    """Key -> (inode, change time) of the values written through one tier object."""

    def __init__(self) -> None:
        self._own: dict[str, tuple[int, int]] = {}

    def record(self, key: str, path: str) -> None:
        """Remember the value of ``key`` just written at ``path``."""
        try:
            st = os.stat(path)
        except OSError:  # gone already (evicted): nothing to trust
            self._own.pop(key, None)
            return
        if len(self._own) >= MAX_OWN:
            self._own.clear()
        self._own[key] = (st.st_ino, st.st_ctime_ns)

    def wrote(self, key: str, st: os.stat_result) -> bool:
        """Whether the file of ``key`` opened with status ``st`` is one written here."""
        return self._own.get(key) == (st.st_ino, st.st_ctime_ns)
