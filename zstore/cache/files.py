"""Files in a tier directory: opened, created and written with the tier's mode (``0600``,
or ``0660`` where the directory is shared with a group; see
:mod:`zstore.cache.ownership`), whatever the umask."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
from collections.abc import Callable

from zstore.cache.ownership import GROUP_FILE, PRIVATE_FILE, shared_gid


def open_file(path: str, flags: int) -> int:
    """``os.open`` for a file in a tier directory, ``0600`` (``0660`` where the directory
    is shared with a group) whatever the umask."""
    mode = PRIVATE_FILE if shared_gid(os.path.dirname(path)) is None else GROUP_FILE
    fd = os.open(path, flags, mode)
    if flags & os.O_CREAT:
        try:
            os.fchmod(fd, mode)
        except OSError:
            pass  # not ours: a shared file another member created
    return fd


def fix_file(path: str) -> None:
    """Give a file created by a library (SQLite, diskcache) the tier's file mode."""
    mode = PRIVATE_FILE if shared_gid(os.path.dirname(path)) is None else GROUP_FILE
    try:
        if stat.S_IMODE(os.stat(path).st_mode) != mode:
            os.chmod(path, mode)
    except OSError:
        pass


def write_json(path: str, data: object) -> bool:
    """Write ``data`` to ``path`` in a tier directory atomically (temp file + rename), with
    the tier's file mode; False when it could not be written (best effort: what callers
    keep there is a record, never data)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with os.fdopen(open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
        return True
    except OSError:
        return False


def make_new(path: str, write: Callable[[str], None]) -> None:
    """Make the file at ``path``: ``write(tmp)`` fills a file of this thread's own name,
    given the tier's mode and put at ``path`` unless another process put one there
    first (theirs stays: processes that opened it already use it; a rename would replace
    it, leaving them with a file no one else reads).  Nothing is left at the temporary
    name, whatever fails (OSError is raised)."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # threads may make it at once
    try:
        write(tmp)
        fix_file(tmp)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: a rename, unless one is there
            if not os.path.exists(path):
                os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
