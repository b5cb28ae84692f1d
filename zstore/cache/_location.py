"""Where a tier may live: a directory of this user's own (or, opted in, one group's)
on a local file system.  SQLite's locking is unsafe on network file systems, and a
directory others can write could feed planted values to training."""

from __future__ import annotations

import os

from zstore.cache.ownership import describe, make_dir, problem

#: Directories zstore keeps in a tier directory (the first tier's: see tiers.node_dir).
NODE_SUBDIRS = ("stats", "locks", "formats", "fsspec-info", "layouts")


def refusal(directory: str, gid: int | None) -> str | None:
    """Why a tier must not use ``directory`` (creating it if missing), else None: it and
    the directories zstore keeps in it must be writable by this user only (or, opted in,
    by one group)."""
    why = make_dir(directory, gid)
    for sub in NODE_SUBDIRS if why is None else ():
        path = os.path.join(directory, sub)
        why = problem(path, gid) if os.path.lexists(path) else None
        if why is not None:
            directory = path
            break
    if why is None:
        return None
    return (
        f"{directory} {why} ({describe(directory)}); a directory others can write "
        "could feed planted values to training. Use a directory of your own "
        "(chmod 700), or opt in to sharing with a group (shared_group=)"
    )
