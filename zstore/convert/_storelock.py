"""One writer at a time on a store: conversions and appends hold the store's lock.

Two appends that each read the manifest and write it back lose one another's items; an
append that writes objects while a ``convert --overwrite`` wipes the store leaves a
broken one.  Every command that writes a store therefore holds its lock, ``zstore.lock``
at the store's root, from before it reads the manifest until after it publishes:

- on a local disk or NFS, an ``flock`` on that file (NFS clients map it to a lock on the
  server); the kernel releases it when the holder dies, so a killed writer never leaves
  a stale lock.  The holder removes the file when it is done (zarr would list it as an
  unknown object), and a waiter that then holds a removed file's lock tries again;
- on an object store (S3 and other fsspec URLs), an object created with a conditional
  write (``If-None-Match: *``): exactly one writer creates it.  It names its holder and
  is deleted on release; a writer killed while holding it leaves it, and the error that
  the next writer gets names the object and its holder so that a person can delete it:
  at once when the holder was a process of the same host that is gone, else after
  waiting ``REMOTE_WAIT`` for it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from zstore.errors import DestinationError
from zstore.processes import alive, boot_and_namespace
from zstore.urls import is_url, local_path

LOCK_NAME = "zstore.lock"
#: a file an atomic write left unfinished when its writer was killed: zarr's
#: (``zarr.<32 hex digits>.partial``) or zstore's (``<name>.<pid>.partial``)
PARTIAL = re.compile(r".+\.([0-9a-f]{32}|[0-9]+)\.partial")
#: How long a writer waits for a remote store's lock before giving up (seconds).
REMOTE_WAIT = 600.0


def _holder() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.time(),
        **boot_and_namespace(),
    }


@contextlib.contextmanager
def store_lock(
    dst: str, storage_options: dict[str, Any] | None = None, *, wait: float = REMOTE_WAIT
) -> Iterator[None]:
    """Hold the write lock of the store at ``dst`` (created when missing)."""
    if is_url(dst):
        with _object_lock(dst, storage_options, wait):
            yield
        return
    path = os.path.join(os.path.abspath(local_path(dst)), LOCK_NAME)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = _flock(path)
    except OSError as e:
        raise DestinationError(
            f"{dst}: cannot create the store there ({e}); choose a writable destination"
        ) from None
    try:
        yield
    finally:  # unlinked while held: a waiter on this file finds it gone and retries
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        os.close(fd)


def _flock(path: str) -> int:
    """An open descriptor of ``path`` holding an exclusive flock on the file that is at
    ``path`` now (a store wiped and recreated meanwhile has a new lock file)."""
    told = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if not told:
                    print(
                        f"zstore: waiting for another conversion or append of "
                        f"{os.path.dirname(path)} to finish (it holds {path})",
                        file=sys.stderr,
                    )
                    told = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def wipe(dst: str, storage_options: dict[str, Any] | None = None) -> None:
    """Delete everything in the store at ``dst`` but its lock (``--overwrite``): a writer
    waiting for the lock keeps waiting on the same lock.  The root ``zarr.json`` goes
    first: a job reading the store finds it gone before any object it reads is gone,
    and is told the store was replaced, not that it is damaged (deleted in directory
    order, the job found a shard gone while the root was still there)."""
    if not is_url(dst):
        root = os.path.abspath(local_path(dst))
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            os.unlink(os.path.join(root, "zarr.json"))
        for entry in os.scandir(root) if os.path.isdir(root) else []:
            if entry.name == LOCK_NAME:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        return
    import fsspec

    fs, path = fsspec.core.url_to_fs(dst, **(storage_options or {}))
    try:
        children = fs.ls(path, detail=False, refresh=True)
    except FileNotFoundError:
        return
    names = {c: c.rstrip("/").rsplit("/", 1)[-1] for c in children}
    for c, name in names.items():
        if name == "zarr.json":  # first, as above
            fs.rm_file(c)
    doomed = [c for c, name in names.items() if name not in (LOCK_NAME, "zarr.json")]
    if doomed:
        fs.rm(doomed, recursive=True)


@contextlib.contextmanager
def _object_lock(dst: str, storage_options: dict[str, Any] | None, wait: float) -> Iterator[None]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(dst, **(storage_options or {}))
    path = f"{root.rstrip('/')}/{LOCK_NAME}"
    mine = json.dumps(_holder()).encode()
    deadline, delay, told = time.monotonic() + wait, 0.05, False
    while True:
        try:
            fs.pipe_file(path, mine, mode="create")
            break
        except FileExistsError:
            pass
        except Exception as e:  # the first write to the destination: say why in one line
            raise DestinationError(
                f"{dst}: cannot write there ({_first_line(e)}); check "
                "the URL, the endpoint and the credentials "
                "(--storage-option, or the usual environment "
                "variables)"
            ) from None
        holder, gone = _read_holder(fs, path)
        if gone:  # killed on this host: waiting would only end in the error below
            raise DestinationError(
                f"{dst}: the store's lock ({dst.rstrip('/')}/{LOCK_NAME}) is {holder}, "
                "which is no longer running (killed while converting or appending): "
                "delete that object and rerun; the rerun finishes the work"
            ) from None
        if time.monotonic() > deadline:
            raise DestinationError(
                f"{dst}: another conversion or append holds the store's lock "
                f"({dst.rstrip('/')}/{LOCK_NAME}: {holder}); wait for it to finish, or, if "
                "that process is gone, delete that object and rerun"
            ) from None
        if not told:
            print(
                f"zstore: waiting for another conversion or append of {dst} to finish ({holder})",
                file=sys.stderr,
            )
            told = True
        time.sleep(delay)
        delay = min(delay * 2, 2.0)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            if fs.cat_file(path) == mine:
                fs.rm_file(path)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _read_holder(fs: Any, path: str) -> tuple[str, bool]:
    """Who holds the lock object at ``path``, in words, and whether it is a process of
    this host (and boot, and pid namespace) that is no longer running.  The object is
    never removed here: a process of another host cannot be checked, and two waiters
    that each removed a lock they found stale could remove one another's new lock."""
    try:
        doc = json.loads(fs.cat_file(path))
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(doc["since"])))
        text = f"held by pid {doc['pid']} on {doc['host']} since {since}"
        here, pid = boot_and_namespace(), int(doc["pid"])
        mine = doc["host"] == socket.gethostname() and len(here) == 2
        mine = mine and all(doc.get(k) == v for k, v in here.items())
        return text, mine and pid > 0 and not alive(pid)  # <= 0: not a pid written here
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown", False


def stale_partials(dst: str, below: Iterable[str] | None = None) -> list[str]:
    """The temporary files of atomic writes cut short (:data:`PARTIAL`) in the local
    store ``dst``: all of them (``below`` None), or those under each of ``below``
    (paths in the store; one that is missing has none; the root itself is not listed:
    items may lie there by the million).  Holding the store's lock, no other writer of
    the store runs, so each is a killed writer's.  None for an object store (whose
    writes leave no such files)."""
    if is_url(dst):
        return []
    root = os.path.abspath(local_path(dst))
    tops = [root] if below is None else [os.path.join(root, sub) for sub in set(below)]
    found: list[str] = []
    for top in tops:
        for here, _, names in os.walk(top):
            found += [os.path.join(here, n) for n in names if PARTIAL.fullmatch(n)]
    return sorted(found)


def remove_stale_partials(dst: str, below: Iterable[str] | None = None) -> int:
    """Remove :func:`stale_partials` (holding the store's lock); how many went."""
    gone = 0
    for path in stale_partials(dst, below):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            gone += 1
    return gone
