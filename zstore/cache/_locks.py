"""Striped file locks so that, node-wide, one process fetches a missing key and the others wait.

Without them, ranks that miss the same chunk at once would all read the origin.
A lock is ``flock`` on one of ``stripes`` files, picked by a hash of the key; the
kernel drops it when its holder dies, so a killed process never leaves one held.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable, Iterator

from crc32c import crc32c

from zstore.cache.files import open_file
from zstore.cache.ownership import make_dir

#: Descriptors this process holds locks through.  A forked child closes its copies:
#: ``flock`` belongs to the open file, which the child shares, so a copy the child kept
#: would hold the lock for as long as the child lives (a DataLoader worker forked while
#: a fill behind the reads held a shard's lock would block every later build of it).
_HELD: set[int] = set()


def _close_inherited() -> None:
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited)


class StripedLocks:
    """Node-wide locks over keys, in ``directory`` (``kind`` separates lock orders)."""

    def __init__(self, directory: str, kind: str, stripes: int = 1024):
        self.directory = directory
        self.kind = kind
        self.stripes = stripes
        self._ready = -1  # the pid that found the directory safe (checked once per process)

    def _stripe(self, key: str) -> int:
        return crc32c(key.encode()) % self.stripes

    def _stripes(self, keys: Iterable[str]) -> list[int]:
        # Sorted and unique: a fixed order prevents deadlock, and flock on two
        # descriptors of one file in one process would block on itself.
        return sorted({self._stripe(k) for k in keys})

    @contextlib.contextmanager
    def hold(self, keys: Iterable[str]) -> Iterator[None]:
        """Hold the locks of ``keys`` (best effort: without a lock directory, no locking)."""
        fds = self.acquire(keys)
        assert fds is not None
        try:
            yield
        finally:
            self.release(fds)

    def acquire(self, keys: Iterable[str], *, wait: bool = True) -> list[int] | None:
        """Take the locks of ``keys``; the descriptors to :meth:`release` (from any thread
        of this process: a build behind the reads releases what its reader took).  With
        ``wait=False``, None at once when another holder has one of them."""
        fds: list[int] = []
        try:
            for stripe in self._stripes(keys):
                try:
                    if not self._safe():
                        continue  # not a safe place: no lock (see ownership)
                    fd = self._open(stripe)
                except OSError:
                    continue  # a lock is an optimisation; correctness never depends on it
                _HELD.add(fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
                except BlockingIOError:
                    self.release([fd, *fds])
                    return None
                except BaseException:
                    self.release([fd])
                    raise
                fds.append(fd)
        except BaseException:
            self.release(fds)
            raise
        return fds

    def acquire_free(self, keys: Iterable[str]) -> tuple[list[int], set[str]]:
        """Take the locks of ``keys`` that no other holder has now, waiting for none;
        the descriptors to :meth:`release`, and the keys whose lock is held."""
        by_stripe: dict[int, list[str]] = {}
        for key in keys:
            by_stripe.setdefault(self._stripe(key), []).append(key)
        fds: list[int] = []
        busy: set[str] = set()
        for stripe in sorted(by_stripe):
            got = self.acquire(by_stripe[stripe][:1], wait=False)
            if got is None:
                busy.update(by_stripe[stripe])
            else:
                fds += got
        return fds, busy

    def _safe(self) -> bool:
        if self._ready != os.getpid():
            if make_dir(self.directory) is not None:
                return False
            self._ready = os.getpid()
        return True

    def _open(self, stripe: int) -> int:
        """A new descriptor of the stripe's lock file (each acquire needs its own: flock
        on one descriptor from two threads would not exclude them)."""
        path = os.path.join(self.directory, f"{self.kind}{stripe:04d}")
        try:
            return os.open(path, os.O_RDWR)  # the common case: made by an earlier holder
        except FileNotFoundError:
            return open_file(path, os.O_RDWR | os.O_CREAT)

    @staticmethod
    def release(fds: list[int]) -> None:
        for fd in fds:
            _HELD.discard(fd)
            os.close(fd)
