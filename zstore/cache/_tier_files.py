"""The tier's value files: diskcache's ``Disk`` as the tier writes them (page-rounded
sizes, one level of 256 subdirectories, the tier's modes, large SSD values around the
page cache), and a value file written before its index row (:class:`Written`)."""

from __future__ import annotations

import os
import threading
from typing import Any

import diskcache

from zstore.cache._direct import DIRECT_MIN, write_direct
from zstore.cache._space import rounded
from zstore.cache.files import fix_file
from zstore.cache.ownership import make_dir


class TierDisk(diskcache.Disk):
    """diskcache's Disk with page-rounded sizes, one level of 256 subdirectories, and
    the tier's modes on what it creates (see :mod:`zstore.cache.ownership`).

    ``last_path`` (the file the calling thread created last) is per thread: a process's
    reads, RAM fills and SSD writes write value files at once, outside the index's lock
    (one shared attribute gave a thread another's path, or None)."""

    _made: set[str] | None = None
    #: Write value files around the page cache (the SSD tier; see
    #: :mod:`zstore.cache._direct`).
    direct = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._thread = threading.local()

    @property
    def last_path(self) -> str | None:
        return getattr(self._thread, "path", None)

    @last_path.setter
    def last_path(self, path: str | None) -> None:
        self._thread.path = path

    def filename(
        self, key: Any = diskcache.core.UNKNOWN, value: Any = diskcache.core.UNKNOWN
    ) -> tuple[str, str]:
        name = os.urandom(16).hex()
        filename = os.path.join(name[:2], name[2:] + ".val")
        if self._made is None:
            self._made = set()
        if name[:2] not in self._made:  # 0700 (2770 shared), not the umask's 0755
            make_dir(os.path.join(self._directory, name[:2]))
            self._made.add(name[:2])
        self.last_path = os.path.join(self._directory, filename)
        return filename, self.last_path

    def _write(self, full_path: str, iterator: Any, mode: str, encoding: Any = None) -> int:
        """diskcache's file write; around the page cache where ``direct`` is set and
        the value is large (:mod:`zstore.cache._direct`)."""
        if self.direct and mode == "xb":
            parts = list(iterator)
            if sum(len(p) for p in parts) >= DIRECT_MIN:
                try:
                    written = write_direct(full_path, parts)
                except FileNotFoundError:  # its directory went: diskcache makes it again
                    written = None
                else:
                    if written is None:  # the file system refuses it: buffered from now on
                        self.direct = False
                if written is not None:
                    return written
            iterator = iter(parts)
        return int(super()._write(full_path, iterator, mode, encoding))

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN) -> Any:
        if isinstance(value, Written):  # written before the index's transaction
            return value.stored
        size, mode, filename, db_value = super().store(value, read, key=key)
        if filename:
            fix_file(os.path.join(self._directory, filename))
        return rounded(size), mode, filename, db_value


class Written:
    """A value file already written at ``path`` (what :meth:`TierDisk.store` returned for
    it).  Until its index row is committed, a sweep may take it for a killed writer's
    file (after a minute): the insert then writes it again, under the index's lock."""

    def __init__(self, stored: Any, path: str):
        self.stored, self.path = stored, path
