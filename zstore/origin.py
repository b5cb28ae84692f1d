"""The origin: where a store really lives (local path, NFS, or any fsspec URL such as S3).

:class:`Origin` reads whole objects and byte ranges, many at once, with a bounded
number of requests in flight, retries for transient errors under an overall
deadline, and a length check so a truncated response is never taken for data.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec

from zstore.buffers import Slabs
from zstore.errors import IntegrityError, OriginError
from zstore.urls import is_url, local_fs_kind, local_path, store_bytes, zarr_store

__all__ = [
    "Origin",
    "OriginError",
    "Request",
    "RetryPolicy",
    "TransientError",
    "describe",
    "is_transient",
    "is_url",
    "local_path",
    "store_bytes",
    "zarr_store",
]

T = TypeVar("T", bytes, memoryview)

#: (key, start, stop): stop None reads to the end; start < 0 reads a suffix of -start bytes.
Request = tuple[str, int | None, int | None]


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff for transient origin errors."""

    attempts: int = 6
    first_delay: float = 0.05
    max_delay: float = 2.0
    deadline: float = 120.0


class TransientError(OSError):
    """A retryable failure (truncated response, reset connection, throttling, 5xx)."""


_PERMANENT = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ValueError,
    TypeError,
    KeyError,
    IntegrityError,
)
_TRANSIENT_WORDS = (
    "timeout",
    "timed out",
    "throttl",
    "slowdown",
    "slow down",
    "reset",
    "connection",
    "503",
    "500",
    "502",
    "504",
    "internalerror",
    "serviceunavailable",
    "temporar",
    "broken pipe",
)


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: timeouts, resets, throttling, 5xx, truncation."""
    if isinstance(exc, TransientError):
        return True
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, OSError) and exc.errno in (
        errno.EIO,
        errno.EAGAIN,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ESTALE,
    ):
        return True
    text = f"{type(exc).__name__} {exc}".lower()
    if "403" in text or "404" in text or "accessdenied" in text or "nosuchkey" in text:
        return False
    return any(w in text for w in _TRANSIENT_WORDS)


def describe(key: str, start: int | None, stop: int | None) -> str:
    if start is None and stop is None:
        return key
    if start is not None and start < 0:
        return f"{key} (last {-start} bytes)"
    return f"{key} bytes [{start or 0}, {'end' if stop is None else stop})"


class Origin:
    """Byte reader for one store root.  Safe to share between threads; pickles as its URL.

    Missing objects raise :class:`FileNotFoundError` (zarr reads those as fill
    values); every other failure, after retries, raises :class:`OriginError`
    naming the store, key and byte range.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        max_requests: int = 16,
        retry: RetryPolicy = RetryPolicy(),
        fs: Any = None,
    ):
        self.url = os.fspath(url).rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.max_requests = max_requests
        self.retry = retry
        self._fs_given = fs
        self._pid = -1
        self.requests = 0
        self.bytes = 0
        self._count_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "storage_options": self.storage_options,
            "max_requests": self.max_requests,
            "retry": self.retry,
            "fs": self._fs_given,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(
            self,
            state["url"],
            state["storage_options"],
            max_requests=state["max_requests"],
            retry=state["retry"],
            fs=state["fs"],
        )

    def _open(self) -> None:
        if self._pid == os.getpid():  # nothing opened before a fork is reused after it
            return
        self._pool: cf.ThreadPoolExecutor | None = None
        self._slabs = Slabs()  # reused memory for ranges of local files (zstore.buffers)
        if self._fs_given is not None:
            self._fs, self._root = self._fs_given, self.url
        elif is_url(self.url):
            self._fs, self._root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        else:
            self._fs, self._root = None, local_path(self.url)
        # Local disks answer a read in microseconds, so ranges are read in turn; a network
        # file system (NFS, Lustre, ...) costs a round trip each, so they overlap.

        network, local_disk = local_fs_kind(self._root) if self._fs is None else (False, False)
        self._concurrent = self._fs is not None or network
        self._local_disk = local_disk
        # set last: a thread that sees this process's pid uses every attribute above.  Set
        # first, a second thread's first call (WindowLoader's batch thread beside a fill)
        # found it halfway and failed on a missing attribute.  Two threads that open it at
        # once each make the same things; the last one's stay, the other's are let go.
        self._pid = os.getpid()

    @property
    def remote(self) -> bool:
        """Whether each read costs a round trip: a URL, a given file system, or a path on
        a network file system (NFS, Lustre, ...)."""
        self._open()
        return self._concurrent

    @property
    def local_disk(self) -> bool:
        """Whether the store is on a local disk file system (ext4, xfs, ...): a small
        read from it is a page-cache copy, cheaper than a lookup in a tier."""
        self._open()
        return self._local_disk

    def round_trip(self, key: str = "zarr.json", tries: int = 2) -> float:
        """Seconds one small read of ``key`` takes: the least of ``tries`` reads (the
        first may set up a connection).  A missing object is timed the same."""
        best = float("inf")
        for _ in range(tries):
            t0 = time.perf_counter()
            try:
                self.read(key)
            except FileNotFoundError:
                pass
            best = min(best, time.perf_counter() - t0)
        return best

    def _read_once(self, key: str, start: int | None, stop: int | None) -> bytes:
        if self._fs is None:
            with open(os.path.join(self._root, key), "rb") as f:
                if start is not None and start < 0:
                    size = os.fstat(f.fileno()).st_size
                    start = max(0, size + start)
                f.seek(start or 0)
                data = f.read() if stop is None else f.read(stop - (start or 0))
        else:
            path = f"{self._root}/{key}"
            if start is not None and start < 0:
                data = self._fs.cat_file(path, start=start)
            elif start is None and stop is None:
                data = self._whole(path)
            else:
                data = self._fs.cat_file(path, start=start, end=stop)
        if stop is not None and start is not None and start >= 0 and len(data) != stop - start:
            raise TransientError(f"short read: {len(data)} of {stop - start} bytes")
        return bytes(data)

    def _whole(self, path: str) -> bytes:
        """A remote object read whole in one request: as the range from byte 0, since
        s3fs reads a whole object with a HEAD for its size first, which made the store's
        root (read beside every round of chunk reads) two round trips.  An empty object
        has no such range (416): it is read as asked."""
        assert self._fs is not None
        try:
            return bytes(self._fs.cat_file(path, start=0))
        except FileNotFoundError:
            raise
        except OSError as e:
            if e.errno != errno.EINVAL and "not satisfiable" not in str(e):
                raise
            return bytes(self._fs.cat_file(path))

    def _read_into(self, key: str, start: int, view: memoryview) -> memoryview:
        """Read ``len(view)`` bytes of local object ``key`` from ``start`` into ``view``."""
        fd = os.open(os.path.join(self._root, key), os.O_RDONLY)
        try:
            got = 0
            while got < len(view):
                n = os.preadv(fd, [view[got:]], start + got)
                if n == 0:
                    break
                got += n
        finally:
            os.close(fd)
        if got != len(view):
            raise TransientError(f"short read: {got} of {len(view)} bytes")
        return view

    def read(self, key: str, start: int | None = None, stop: int | None = None) -> bytes:
        """Read one object or byte range, retrying transient errors."""
        return self._retried(key, start, stop, lambda: self._read_once(key, start, stop))

    def _read_range(self, request: Request, view: memoryview | None) -> bytes | memoryview:
        """``request`` read into ``view`` (reused memory, see read_many) when given."""
        key, start, stop = request
        if view is None:
            return self.read(key, start, stop)
        return self._retried(key, start, stop, lambda: self._read_into(key, start or 0, view))

    def _retried(self, key: str, start: int | None, stop: int | None, once: Callable[[], T]) -> T:
        """``once()`` (one read of ``key``'s range), retrying transient errors."""
        self._open()
        policy, t0, delay = self.retry, time.monotonic(), self.retry.first_delay
        for attempt in range(1, policy.attempts + 1):
            try:
                data = once()
            except FileNotFoundError:
                raise
            except Exception as e:  # classified below: retried or raised with context
                late = time.monotonic() - t0 + delay > policy.deadline
                if not is_transient(e) or attempt == policy.attempts or late:
                    tries = f" after {attempt} attempts" if attempt > 1 else ""
                    raise OriginError(
                        f"{self.url}: reading {describe(key, start, stop)} "
                        f"failed{tries}: {type(e).__name__}: {e}"
                    ) from e
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, policy.max_delay)
                continue
            with self._count_lock:
                self.requests += 1
                self.bytes += len(data)
            return data
        raise AssertionError("unreachable")

    def buffer(self, nbytes: int) -> memoryview | None:
        """A view of this process's reused read memory to read ``nbytes`` into (the
        tiers' chunk values, like the ranges of local files), or None: new memory.
        What is read into it stays valid as long as it is referred to."""
        self._open()
        return self._slabs.take(nbytes)

    def release_idle(self) -> None:
        """Let the reused read memory go when no range was read since the last call
        (:meth:`zstore.buffers.Slabs.release_idle`)."""
        if self._pid == os.getpid():
            self._slabs.release_idle()

    def read_many(self, requests: list[Request]) -> list[bytes | memoryview]:
        """Read several ranges concurrently (at most ``max_requests`` in flight).

        Ranges of a local or network file system's objects land in reused memory
        (:mod:`zstore.buffers`): what is returned is a view of it, valid as long as it
        is referred to."""
        self._open()
        views: list[memoryview | None] = [
            self._slabs.take(stop - start)
            if self._fs is None and start is not None and start >= 0 and stop is not None
            else None
            for _, start, stop in requests
        ]
        if len(requests) <= 1 or not self._concurrent:
            return [self._read_range(r, v) for r, v in zip(requests, views)]
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(self.max_requests, thread_name_prefix="zstore")
        try:
            futures = [self._pool.submit(self._read_range, r, v) for r, v in zip(requests, views)]
        except RuntimeError:  # the interpreter is exiting: a fill finishing at exit
            return [self._read_range(r, v) for r, v in zip(requests, views)]
        return [f.result() for f in futures]
