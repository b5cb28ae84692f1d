"""A destination that runs out of space while the converter writes to it.

The writes of a conversion or an append (the workers' chunks, the parent's metadata)
fail with ``ENOSPC`` or ``EDQUOT`` when the disk or the user's quota is full; that
surfaced as a worker's traceback ending in ``OSError: [Errno 28] No space left on
device``.  It is now one error naming the destination, the space left there, and that a
rerun goes on: what was written is kept (items are complete only once marked, so a
rerun rewrites any item cut short).
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager

from zstore.errors import DestinationError, ZstoreError
from zstore.units import format_size
from zstore.urls import disk_usage_under, is_url

#: the errors of a full disk and of a full quota
FULL = (errno.ENOSPC, errno.EDQUOT)


def _free(dst: str) -> str:
    """What is free where a local ``dst`` lies (its nearest existing parent), for the
    message; nothing for a URL or where it cannot be told."""
    usage = None if is_url(dst) else disk_usage_under(dst)
    if usage is None:
        return ""
    return f"; {format_size(usage.free)} free of {format_size(usage.total)} there"


@contextmanager
def destination_space(dst: str) -> Iterator[None]:
    """Turn a write that failed for want of space under ``dst`` into one
    :class:`DestinationError` that says so and that the same command goes on."""
    try:
        yield
    except OSError as e:
        if isinstance(e, ZstoreError) or e.errno not in FULL:
            raise
        raise DestinationError(
            f"{dst}: no space left to write the store ({e.strerror}{_free(dst)}); make "
            "room there, or raise the quota, and run the same command again: what was "
            "written is kept, and the rerun goes on from there"
        ) from None
