"""Where a store lives: URLs and local paths, plain zarr stores for them, bytes under
them, whether a path is on a network file system, and the space of the one under it.

A shared leaf: every layer may import it; it imports no other zstore module.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import fsspec

NETWORK_FS = (
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "smbfs",
    "lustre",
    "gpfs",
    "beegfs",
    "ceph",
    "fuse.sshfs",
    "9p",
    "afs",
    "glusterfs",
    "fuse.glusterfs",
)


#: File systems on the machine's own disks (or memory).  A store on one is read from it
#: directly: an SSD tier would only copy it to a disk of the same kind (measured: epoch
#: 0 at half the speed, later epochs no faster; docs/benchmarks-notes.md).
LOCAL_DISK_FS = (
    "ext2",
    "ext3",
    "ext4",
    "xfs",
    "btrfs",
    "zfs",
    "f2fs",
    "bcachefs",
    "jfs",
    "reiserfs",
    "tmpfs",
    "ramfs",
    "overlay",
)


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def local_path(url: str) -> str:
    """The local path a store or source is named by: ``file://PATH`` is PATH, and ``~``
    is the user's home, as fsspec reads them."""
    return os.path.expanduser(url[len("file://") :] if url.startswith("file://") else url)


def zarr_store(url: str, storage_options: dict[str, Any] | None, *, read_only: bool) -> Any:
    """A plain zarr store (no cache) for a path or fsspec URL."""
    from zarr.storage import FsspecStore, LocalStore

    url = os.fspath(url)
    if is_url(url):
        return FsspecStore.from_url(url, storage_options=storage_options or {}, read_only=read_only)
    path = local_path(url)
    if not read_only:
        os.makedirs(path, exist_ok=True)
    return LocalStore(path, read_only=read_only)


def store_bytes(url: str, storage_options: dict[str, Any] | None = None) -> int:
    """Bytes of every object under ``url``."""
    if not is_url(url):
        total = 0
        for dirpath, _, files in os.walk(local_path(url)):
            total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
        return total
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return int(fs.du(path))


def filesystem_type(path: str) -> str:
    """The type of the file system that holds ``path`` (from /proc/mounts)."""
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if (
                    len(parts) >= 3
                    and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/"))
                    and len(parts[1]) > len(best)
                ):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def network_fs_type(path: str) -> str | None:
    """The file system type of ``path`` when it is a network one (NFS, Lustre, ...), else None."""
    kind = filesystem_type(os.path.abspath(path))
    return kind if kind in NETWORK_FS else None


def local_fs_kind(path: str) -> tuple[bool, bool]:
    """(on a network file system, on a local disk) for local ``path``, from one read of
    /proc/mounts (:func:`network_fs_type` and :func:`on_local_disk` each read it)."""
    kind = filesystem_type(os.path.abspath(path))
    return kind in NETWORK_FS, kind in LOCAL_DISK_FS


def on_local_disk(path: str) -> bool:
    """Whether ``path`` (not a URL) is on a local disk file system (ext4, xfs, ...); False
    for network and FUSE file systems, and where the type is unknown."""
    return not is_url(path) and filesystem_type(os.path.abspath(local_path(path))) in LOCAL_DISK_FS


def disk_usage_under(path: str) -> Any:
    """``shutil.disk_usage`` of the file system that holds the local ``path`` (its
    nearest existing parent: a cache or store directory not made yet), or None where it
    cannot be told."""
    where = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    try:
        return shutil.disk_usage(where)
    except OSError:
        return None
