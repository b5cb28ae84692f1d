"""Testing helpers: an fsspec file system with modelled latency, bandwidth and failures.

``ModelledFileSystem(root, latency=0.02, bandwidth=100e6)`` serves the files under
``root`` as if they lived on S3 (~20 ms a request, ~100 MB/s a stream) or NFS
(~1 ms).  Every request sleeps ``latency + bytes / bandwidth``; concurrent
requests overlap, as separate streams do.  ``fail_next`` and ``truncate_next``
inject transient errors, permanent errors and short responses.  It counts
requests and bytes, so tests and the benchmark can see what reached the origin.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem


class ModelledFileSystem(AbstractFileSystem):
    """A local directory behind a latency/bandwidth model (protocol ``modelled``)."""

    protocol = "modelled"
    cachable = False

    def __init__(
        self, root: str = "/", latency: float = 0.0, bandwidth: float = 0.0, **kwargs: Any
    ):
        super().__init__(**kwargs)
        self.root = os.path.abspath(root)
        self.latency = latency
        self.bandwidth = bandwidth
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes = 0
        #: of those, the reads of ``zarr.json`` documents (a reader checks its store's
        #: root in every round of reads: zstore.read._replaced)
        self.root_requests = 0
        self.root_bytes = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._failures: list[Callable[[], BaseException] | str] = []

    def __reduce__(self) -> Any:
        return (ModelledFileSystem, (self.root, self.latency, self.bandwidth))

    @property
    def data_requests(self) -> int:
        """Requests for anything but ``zarr.json`` documents (chunks, shard indexes)."""
        return self.requests - self.root_requests

    @property
    def data_bytes(self) -> int:
        return self.bytes - self.root_bytes

    def fail_next(self, n: int, error: Callable[[], BaseException]) -> None:
        """Make the next ``n`` data requests raise ``error()`` (``zarr.json`` reads,
        which may come in the same concurrent round, are served)."""
        with self._lock:
            self._failures += [error] * n

    def truncate_next(self, n: int) -> None:
        """Make the next ``n`` data requests return only half their bytes."""
        with self._lock:
            self._failures += ["truncate"] * n

    def reset_counts(self) -> None:
        with self._lock:
            self.requests = self.bytes = self.max_in_flight = 0
            self.root_requests = self.root_bytes = 0

    def _local(self, path: str) -> str:
        path = self._strip_protocol(path)
        if path.startswith(self.root):
            return path
        return os.path.join(self.root, path.lstrip("/"))

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        path = path[len("modelled://") :] if path.startswith("modelled://") else path
        return path.rstrip("/") or "/"

    def _serve(self, path: str, start: int | None, end: int | None) -> bytes:
        root = path.endswith("zarr.json")
        with self._lock:
            injected = self._failures.pop(0) if self._failures and not root else None
            self.requests += 1
            self.root_requests += root
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            with open(self._local(path), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                start = 0 if start is None else (max(0, size + start) if start < 0 else start)
                end = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
                f.seek(start)
                data = f.read(max(0, end - start))
            time.sleep(self.latency + (len(data) / self.bandwidth if self.bandwidth else 0.0))
        finally:
            with self._lock:
                self.in_flight -= 1
        if injected == "truncate":
            data = data[: len(data) // 2]
        elif injected is not None:
            raise injected()  # type: ignore[operator]
        with self._lock:
            self.bytes += len(data)
            if root:
                self.root_bytes += len(data)
        return data

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        return self._serve(path, start, end)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        local = self._local(path)
        if not os.path.exists(local):
            raise FileNotFoundError(path)
        if os.path.isfile(local):
            entries = [local]
        else:
            entries = [os.path.join(local, n) for n in sorted(os.listdir(local))]
        infos = [self._entry(p) for p in entries]
        return infos if detail else [i["name"] for i in infos]

    def _entry(self, local: str) -> dict[str, Any]:
        kind = "directory" if os.path.isdir(local) else "file"
        st = os.stat(local)
        return {
            "name": local,
            "size": st.st_size if kind == "file" else 0,
            "type": kind,
            "mtime": st.st_mtime_ns,
        }

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        local = self._local(path)
        if not os.path.exists(local):
            raise FileNotFoundError(path)
        return self._entry(local)

    def _open(
        self, path: str, mode: str = "rb", block_size: int | None = None, **kwargs: Any
    ) -> AbstractBufferedFile:
        if mode != "rb":
            raise PermissionError(f"{path}: the modelled file system is read-only")
        kwargs.setdefault("cache_type", "readahead")
        return _ModelledFile(self, path, mode, block_size=block_size or 2**20, **kwargs)


class _ModelledFile(AbstractBufferedFile):
    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.fs._serve(self.path, start, end)
