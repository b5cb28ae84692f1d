"""The node's processes whose first read is running, so that work behind the reads
can wait for every rank's first batch, not only its own process's.

Each process marks itself with an empty file named by its pid in a directory every
process on the node shares (``starting`` under the RAM tier, see
:func:`zstore.cache.tiered.node_dir`) while its first read runs.  A file whose process
has exited (killed mid-read) is removed by the next process that looks.
"""

from __future__ import annotations

import contextlib
import os

from zstore.cache.files import open_file
from zstore.cache.ownership import make_dir
from zstore.processes import alive


class FirstReads:
    """This process's mark in ``directory`` (None: no tiers, nothing to mark)."""

    def __init__(self, directory: str | None):
        self.directory = directory
        self._mine: str | None = None

    def begin(self) -> None:
        """Mark this process's first read as running (at most once)."""
        if self.directory is None or self._mine is not None:
            return
        if make_dir(self.directory) is not None:
            self.directory = None  # not usable: this process marks nothing
            return
        path = os.path.join(self.directory, str(os.getpid()))
        with contextlib.suppress(OSError):
            os.close(open_file(path, os.O_CREAT | os.O_WRONLY))
            self._mine = path

    def end(self) -> None:
        """This process's first read is served (or failed)."""
        if self._mine is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._mine)
            self._mine = None

    def others(self) -> bool:
        """Whether another live process on the node has its first read running."""
        if self.directory is None:
            return False
        try:
            names = os.listdir(self.directory)
        except OSError:
            return False
        me, found = os.getpid(), False
        for name in names:
            if not name.isdigit() or int(name) == me:
                continue
            if alive(int(name)):
                found = True
                continue
            with contextlib.suppress(OSError):  # its process was killed mid-read
                os.unlink(os.path.join(self.directory, name))
        return found
