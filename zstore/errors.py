"""Errors raised by zstore.

Each error inherits from :class:`ZstoreError` and from the builtin it refines, so
callers may catch either.  Messages name the file, item, array, key or path at
fault and say what to do.
"""

from __future__ import annotations

from collections.abc import Sequence


def some_names(names: Sequence[str], count: int | None = None, at_most: int = 5) -> str:
    """The first ``at_most`` of ``names`` quoted, and how many more of ``count`` (all
    of ``names`` when None; a caller may pass only the first few), for a message."""
    count = len(names) if count is None else count
    shown = ", ".join(repr(n) for n in names[:at_most])
    return shown + (f" and {count - at_most} more" if count > at_most else "")


class ZstoreError(Exception):
    """Base class of every error zstore raises on purpose."""


class SourceError(ZstoreError, ValueError):
    """The HDF5 source cannot be converted as asked (missing, corrupt, inconsistent)."""


class DestinationError(ZstoreError, FileExistsError):
    """The destination holds something zstore must not overwrite."""


class StoreFormatError(ZstoreError, ValueError):
    """A store is not a zstore store, or its manifest is inconsistent."""


class StoreReplacedError(StoreFormatError):
    """The store at a reader's URL is no longer the one it opened: removed, or replaced
    by a conversion with ``--overwrite`` (its store id changed) while a job read it."""


class ConfigError(ZstoreError, ValueError):
    """An option or ``ZSTORE_*`` environment variable has a value zstore cannot use."""


class ShortItemError(ZstoreError, ValueError):
    """Items are shorter than the window and ``short="error"`` was asked for."""


class OriginError(ZstoreError, OSError):
    """Reading the origin failed for good (after retries, or a permanent error)."""


class IntegrityError(ZstoreError, OSError):
    """Bytes failed their checksum or length check."""


class MissingDataError(IntegrityError):
    """An object the converter wrote is gone from the store (deleted, lost in a copy).

    Never a :class:`FileNotFoundError`: zarr reads a missing object as the fill value,
    which for a store whose converter wrote every chunk would be silent zeros.
    """
