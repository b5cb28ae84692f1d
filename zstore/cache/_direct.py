"""Large value files written around the page cache (``O_DIRECT``), for the SSD tier.

A buffered write puts a value's bytes in the page cache first: fresh memory for every
byte the tier stores, dirty pages for the kernel to write back later, and a second copy
of data the RAM tier may hold already.  Where fresh memory is slow (this benchmark's
virtual machine hands freed memory back to its host), the first epoch's whole-shard SSD
writes cost more CPU than anything else the tiers did: 0.45 s of kernel time for 238 MB
with 4 ranks on the NFS-like origin, and epoch 0 read at 0.66x of no tiers with an SSD
tier alone; written directly, 0.93x (docs/benchmarks-notes.md, "SSD writes around the
page cache").

A direct write needs its buffer, offset and length aligned to the device's block, so
the value is copied into a reused, page-aligned buffer (one per writing thread), written
with its last block padded, and the file cut back to the value's length.  Only values
of ``DIRECT_MIN`` bytes and more go this way (whole shards, written behind the reads):
a small value's synchronous device write would cost a read path more than its page
cache pages.  A file system that refuses ``O_DIRECT`` gets a buffered write, as before.

Reading a value written so goes to the device the first time (later reads find it in
the page cache, as with any file).

May import: nothing of zstore.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Sequence

#: The alignment of a direct write's buffer and length (a 4 KiB block; devices with
#: 512-byte blocks accept it too).
ALIGN = 4096
#: Values smaller than this are written the buffered way.
DIRECT_MIN = 1 << 20
#: A thread keeps its buffer up to this size; a larger value gets memory of its own.
KEEP = 64 << 20


class _Buffer(threading.local):
    buf: mmap.mmap | None = None


_BUFFER = _Buffer()


def _buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned memory of at least ``nbytes``, the thread's own when it is kept."""
    size = max(-(-nbytes // (1 << 20)) << 20, 1 << 20)
    kept = _BUFFER.buf
    if kept is not None and len(kept) >= size:
        return kept
    new = mmap.mmap(-1, size)
    if size <= KEEP:
        if kept is not None:
            kept.close()
        _BUFFER.buf = new
    return new


def write_direct(path: str, parts: Sequence[bytes | memoryview], mode: int = 0o600) -> int | None:
    """Write ``parts``, one after the other, to the new file ``path`` around the page
    cache; the bytes written, or None when the file system refuses direct writes
    (nothing is left at ``path`` then: write it the buffered way).  Other errors are
    raised: ``FileExistsError`` leaving the existing file alone, and any error once
    the file is created (a full disk) with the file removed."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, mode)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return None
        raise
    nbytes = sum(len(p) for p in parts)
    padded = -(-nbytes // ALIGN) * ALIGN
    buf = _buffer(padded)
    ok = False
    try:
        with memoryview(buf) as view:
            at = 0
            for part in parts:
                view[at : at + len(part)] = memoryview(part).cast("B")
                at += len(part)
            view[at:padded] = bytes(padded - at)
            done = 0
            while done < padded:
                try:
                    done += os.pwrite(fd, view[done:padded], done)
                except OSError as e:
                    if e.errno == errno.EINVAL:  # the device's alignment is not met
                        return None
                    raise
        os.ftruncate(fd, nbytes)
        ok = True
        return nbytes
    finally:
        os.close(fd)
        if not ok:
            try:
                os.unlink(path)
            except OSError:
                pass
        if buf is not _BUFFER.buf:
            buf.close()
