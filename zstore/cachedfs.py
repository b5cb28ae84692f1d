"""zstore's tiers as an fsspec caching layer, for any file on any fsspec file system.

    fs = zstore.cached_filesystem("s3://bucket", storage_options={...}, cache=...)
    with fs.open("bucket/corpus.h5") as f: ...            # h5py.File(f), f.read(), ...
    fsspec.open("zstore::s3://bucket/corpus.h5", zstore={"ram_bytes": "8GB"}, s3={...})

Files are read in fixed-size blocks through the node-shared RAM and SSD tiers, with
their budgets, checksums, fill locks (one origin read per block for the node) and
degradation rules.  A block's key carries the file's size and ETag (with the version
id where there is one), or on a local disk or NFS its mtime, inode and ctime, so a file
that changed is never served from stale blocks, even one rewritten with its size and
mtime kept (``cp -p``, ``rsync -a``).  ``ls``, ``info`` and ``exists``
pass through to the target; when the target cannot be reached, a file's last known
details are used and the blocks already cached are served, with one warning
(stale-if-error), so a job survives an origin outage.  Read-only.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from typing import Any

import fsspec
from fsspec.spec import AbstractBufferedFile

try:  # fsspec >= 2025: marks a file system layered over another, so that a chained URL
    # (zstore::s3://bucket/file) hands it the inner path
    from fsspec.implementations.chained import ChainedFileSystem as _Base
except ImportError:  # pragma: no cover - older fsspec: use cached_filesystem() instead
    from fsspec.spec import AbstractFileSystem as _Base

from zstore.cache import CacheConfig, TieredCache, as_cache_config, make_dir, write_json
from zstore.errors import ConfigError, IntegrityError
from zstore.units import parse_size

BLOCK = 4 * 2**20  # bytes a block: few requests for HDF5's scattered reads, little waste
_UNREACHABLE = (OSError, TimeoutError, ConnectionError)


def _unreachable(e: BaseException) -> bool:
    """A failure to reach the target (not a missing file, not bad bytes)."""
    if isinstance(e, (FileNotFoundError, PermissionError, IntegrityError)):
        return False
    name = type(e).__name__
    return isinstance(e, _UNREACHABLE) or "Connect" in name or "Timeout" in name


class CachedFileSystem(_Base):
    """Read-only fsspec file system: ``target`` behind the node-shared cache tiers.

    Args:
        target_protocol: the file system cached (e.g. ``"s3"``), or pass ``fs``.
        target_options: its options (fsspec's ``storage_options``).
        fs: an fsspec file system instance to cache instead.
        block_size: bytes per cached block (default 4 MiB).
        **cache: :class:`zstore.CacheConfig` fields (``ram_bytes="8GB"``, ...), or
            ``cache=CacheConfig(...)``.
    """

    protocol = "zstore"
    cachable = False

    def __init__(
        self,
        target_protocol: str | None = None,
        target_options: dict[str, Any] | None = None,
        fs: Any = None,
        block_size: int | str = BLOCK,
        cache: CacheConfig | None = None,
        fo: str | None = None,
        **config: Any,
    ):
        super().__init__()
        if fs is None:
            if target_protocol is None:
                raise ConfigError(
                    "zstore's cached file system needs a target: "
                    "zstore.cached_filesystem('s3://bucket', ...) or a chained "
                    "URL such as zstore::s3://bucket/file.h5"
                )
            fs = fsspec.filesystem(target_protocol, **(target_options or {}))
        self.fs = fs
        self.block_size = parse_size(block_size, name="block_size")
        if self.block_size < 4096:
            raise ConfigError(f"block_size must be at least 4096 bytes, got {self.block_size}")
        config = {k: v for k, v in config.items() if k in CacheConfig.__dataclass_fields__}
        resolved = (cache or as_cache_config(CacheConfig(**config))).resolved()  # type: ignore
        self.tiers = TieredCache(resolved, "fsspec")
        self._known_dir = self.tiers.node_dir("fsspec-info")
        self._known: dict[str, dict[str, Any]] = {}  # what this process last remembered
        self._warned: set[str] = set()

    # -- metadata: pass through, remembering what was seen ---------------------------

    def _target(self, path: str) -> str:
        """``path`` as the target file system names it (any zstore:: prefix dropped)."""
        path = str(path)
        if path.startswith("zstore::"):
            path = path[len("zstore::") :]
        elif path.startswith("zstore://"):
            path = path[len("zstore://") :]
        return self.fs._strip_protocol(path)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self.fs.ls(self._target(path), detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        """The target's details of ``path``; its last known ones when it is unreachable."""
        path = self._target(path)
        try:
            found = self.fs.info(path, **kwargs)
        except Exception as e:
            known = self._recall(path) if _unreachable(e) else None
            if known is None:
                raise
            self._warn_stale(path, e)
            return known
        self._remember(path, found)
        return found

    def exists(self, path: str, **kwargs: Any) -> bool:
        try:
            self.info(path)
            return True
        except FileNotFoundError:
            return False

    def _version(self, info: dict[str, Any]) -> str:
        """What identifies one version of a file: size plus ETag (and version id) on an
        object store; on a local disk or NFS, the modification time with what ``cp -p``
        and ``rsync -a`` cannot restore: the inode and the change time."""
        tag = info.get("ETag") or info.get("etag")
        if tag:
            version = info.get("VersionId") or info.get("version_id")
            return f"{info.get('size')}:{tag}" + (f":{version}" if version else "")
        tag = (
            info.get("mtime")
            or info.get("LastModified")
            or info.get("last_modified")
            or info.get("created")
        )
        local = [info.get(k) for k in ("ino", "created") if info.get(k) is not None]
        return ":".join(str(x) for x in [info.get("size"), tag, *local])

    def _known_path(self, path: str) -> str | None:
        if self._known_dir is None:
            return None
        name = hashlib.sha1(f"{self.fs.protocol}:{path}".encode()).hexdigest()
        return os.path.join(self._known_dir, f"{name}.json")

    def _remember(self, path: str, info: dict[str, Any]) -> None:
        keep = {k: v for k, v in info.items() if isinstance(v, (str, int, float, bool))}
        if self._known.get(path) == keep:  # unchanged: no write on every open or read
            return
        where = self._known_path(path)
        if where is None or make_dir(os.path.dirname(where)) is not None:
            return
        if write_json(where, keep):
            self._known[path] = keep

    def _recall(self, path: str) -> dict[str, Any] | None:
        where = self._known_path(path)
        try:
            with open(where) as f:  # type: ignore[arg-type]
                return json.load(f)
        except (OSError, TypeError, ValueError):
            return None

    def _warn_stale(self, path: str, error: BaseException) -> None:
        if path not in self._warned:
            self._warned.add(path)
            warnings.warn(
                f"zstore: {self.fs.protocol}://{path} cannot be reached ({error}); "
                "serving the blocks already cached (stale-if-error)",
                stacklevel=4,
            )

    # -- data: fixed-size blocks through the tiers -----------------------------------

    def read_range(
        self, path: str, start: int, end: int, info: dict[str, Any] | None = None
    ) -> bytes:
        """Bytes [start, end) of ``path`` through the tiers (one batch of misses)."""
        info = info or self.info(path)
        size = int(info["size"])
        start, end = max(0, start), min(size, end)
        if end <= start:
            return b""
        version = hashlib.sha1(
            f"{self.fs.protocol}:{path}:{self._version(info)}".encode()
        ).hexdigest()[:24]
        first, last = start // self.block_size, (end - 1) // self.block_size
        blocks = list(range(first, last + 1))
        keys = [f"{version}/b{b}" for b in blocks]
        bounds = {
            k: (b * self.block_size, min(size, (b + 1) * self.block_size))
            for k, b in zip(keys, blocks)
        }

        def fetch(missing: list[str]) -> list[bytes | memoryview | None]:
            starts = [bounds[k][0] for k in missing]
            ends = [bounds[k][1] for k in missing]
            datas = self.fs.cat_ranges([path] * len(missing), starts, ends)  # concurrent
            for data, lo, hi in zip(datas, starts, ends):
                if isinstance(data, BaseException):
                    raise data
                if len(data) != hi - lo:  # a short read is never cached as the block
                    raise IntegrityError(
                        f"{self.fs.protocol}://{path}: bytes [{lo}, {hi}) "
                        f"came back as {len(data)} bytes; the file may "
                        "be changing: try again"
                    )
            self.tiers.stats.add("origin_requests", len(missing))
            self.tiers.stats.add("origin_bytes", sum(len(d) for d in datas))
            return list(datas)

        try:
            values = self.tiers.get_many(keys, fetch)
        except Exception as e:
            if not _unreachable(e):
                raise
            self._warn_stale(path, e)
            values = self.tiers.lookup_many(keys)
            if any(v is None for v in values):
                raise
        data = b"".join(bytes(v) for v in values)  # type: ignore[arg-type]
        offset = first * self.block_size
        return data[start - offset : end - offset]

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        path = self._target(path)
        info = self.info(path)
        size = int(info["size"])
        lo = 0 if start is None else (start if start >= 0 else max(0, size + start))
        hi = size if end is None else (end if end >= 0 else max(0, size + end))
        return self.read_range(path, lo, hi, info)

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: Any = None,
        autocommit: bool = True,
        cache_options: Any = None,
        **kwargs: Any,
    ) -> Any:
        if mode != "rb":
            raise ValueError(
                f"zstore's cached file system is read-only; cannot open {path!r} with mode {mode!r}"
            )
        path = self._target(path)
        return CachedFile(self, path, self.info(path))

    # read-only
    def _rm(self, path: str) -> None:  # pragma: no cover - refused
        raise ValueError("zstore's cached file system is read-only")


class CachedFile(AbstractBufferedFile):
    """A file read through :class:`CachedFileSystem`'s blocks (no second cache)."""

    def __init__(self, fs: CachedFileSystem, path: str, info: dict[str, Any]):
        super().__init__(
            fs, path, mode="rb", block_size=fs.block_size, cache_type="none", size=int(info["size"])
        )
        self._info = info

    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.fs.read_range(self.path, start, end, self._info)


def cached_filesystem(
    target_url: str,
    *,
    cache: CacheConfig | None = None,
    storage_options: dict[str, Any] | None = None,
    block_size: int | str = BLOCK,
) -> CachedFileSystem:
    """An fsspec file system that reads ``target_url``'s file system (``"s3://bucket"``,
    ``"/mnt/nfs"``, ...) through the node-shared cache tiers; paths are the target's."""
    fs, _ = fsspec.core.url_to_fs(target_url, **(storage_options or {}))
    return CachedFileSystem(
        fs=fs, cache=as_cache_config(cache) or CacheConfig(), block_size=block_size
    )
