"""``zstore tidy DST``: remove what appends and killed writers leave in a finished store.

Every append publishes a new item table
(``zstore_items_<hex>``, ~60-70 bytes an item) and leaves the one before it: a job
that opened the store earlier keeps reading its own table, in every DataLoader worker
it starts.  A store of a million items appended to daily grows by ~64 MB a day of
tables nothing new will read.  A converter killed mid-write leaves the temporary files
of its atomic writes (``*.<pid>.partial``, zarr's ``zarr.<32 hex>.partial``) and,
killed while publishing, a table no root ever named.

:func:`tidy` removes, under the store's write lock (so no conversion or append writes
meanwhile):

- item tables the store's root does not name, replaced more than ``older_than``
  seconds ago (when the table after each was written; default a week: give the
  longest a job reading the store may run);
- the temporary files of unfinished writes (local stores; an object store's writes are
  whole).

It never touches the current table, an item, or a store whose conversion has not
finished (that is refused: rerun the conversion first).  A rerun is safe: it finds
nothing more to remove.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from zstore.convert._storelock import stale_partials, store_lock
from zstore.errors import DestinationError
from zstore.format import MANIFEST_ATTR, PROGRESS_ATTR
from zstore.units import format_size, parse_duration
from zstore.urls import is_url, local_path

#: How old a table the root no longer names must be to go (seconds): a week.
OLDER_THAN = 7 * 86400.0
_TABLE = re.compile(r"zstore_items_[0-9a-f]{12}")


@dataclass
class TidyReport:
    """What :func:`tidy` removed (or, ``dry_run``, would remove)."""

    store: str
    tables: list[str] = field(default_factory=list)
    partials: list[str] = field(default_factory=list)
    nbytes: int = 0
    kept_young: list[str] = field(default_factory=list)
    dry_run: bool = False

    def __str__(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        parts = [
            f"{self.store}: {verb} {len(self.tables)} old item table(s) and "
            f"{len(self.partials)} unfinished write(s), {format_size(self.nbytes)}"
        ]
        if self.kept_young:
            parts.append(
                f"kept {len(self.kept_young)} table(s) replaced more recently than "
                "--older-than (a job that opened the store before they were replaced "
                "may still read them)"
            )
        return "; ".join(parts)


def tidy(
    dst: str | os.PathLike[str],
    *,
    older_than: float | str = OLDER_THAN,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> TidyReport:
    """Remove the item tables a finished store's root no longer names and that were
    replaced more than ``older_than`` ago (seconds, or ``"7d"``, ``"12h"``), and the
    temporary files of writes a killed converter left (see the module); ``dry_run``:
    only say what would go.  Holds the store's write lock, so it waits for a
    conversion or append."""
    dst = os.fspath(dst)
    age = parse_duration(older_than, name="older_than")
    fs, root = _fs(dst, storage_options)
    report = TidyReport(dst, dry_run=dry_run)
    _current_table(fs, root, dst)  # before the lock, which would make a missing store
    with store_lock(dst, storage_options):
        current = _current_table(fs, root, dst)
        now = time.time()
        for name, replaced in _replaced_tables(fs, root, current):
            path = f"{root}/{name}"
            if now - replaced < age:
                report.kept_young.append(name)
                continue
            report.tables.append(name)
            report.nbytes += _bytes(fs, path)
            if not dry_run:
                fs.rm(path, recursive=True)
        if not is_url(dst):
            for path in stale_partials(dst):
                report.partials.append(os.path.relpath(path, root))
                report.nbytes += os.path.getsize(path)
                if not dry_run:
                    os.unlink(path)
    return report


def _fs(dst: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    import fsspec

    if not is_url(dst):
        return fsspec.filesystem("file"), os.path.abspath(local_path(dst))
    fs, root = fsspec.core.url_to_fs(dst, **(storage_options or {}))
    return fs, root.rstrip("/")


def _current_table(fs: Any, root: str, dst: str) -> str | None:
    """The table the root names (None: a store of the format before tables); refuses
    what is not a finished zstore store."""
    try:
        meta = json.loads(fs.cat_file(f"{root}/zarr.json"))
    except (FileNotFoundError, NotADirectoryError):
        raise DestinationError(f"{dst}: no store there (no zarr.json)") from None
    except ValueError:
        raise DestinationError(f"{dst}: its zarr.json is not JSON; not a zstore store") from None
    attrs = meta.get("attributes") or {}
    header = attrs.get(MANIFEST_ATTR)
    if not isinstance(header, dict):
        if PROGRESS_ATTR in attrs:
            raise DestinationError(
                f"{dst}: its conversion has not finished; run it again to finish it "
                "(nothing was removed)"
            )
        raise DestinationError(f"{dst}: not a zstore store (no manifest in its zarr.json)")
    table = header.get("table")
    return str(table) if table else None


def _replaced_tables(fs: Any, root: str, current: str | None) -> list[tuple[str, float]]:
    """The item tables other than ``current``, each with when it was replaced: when the
    table after it was written (a job that opened the store until then reads it),
    or, for one written after every other (a publish that never finished), when it
    was written itself."""
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False, refresh=True)]
    written = sorted(
        (_written(fs, f"{root}/{name}"), name) for name in names if _TABLE.fullmatch(name)
    )
    out = []
    for i, (when, name) in enumerate(written):
        if name != current:
            out.append((name, written[i + 1][0] if i + 1 < len(written) else when))
    return out


def _written(fs: Any, path: str) -> float:
    """When the table at ``path`` was written (seconds since the epoch): its metadata's
    time, or its data's where a publish killed between the two (data first) left no
    metadata; 0 for a table with neither.  A file system that cannot say stops tidy:
    taking every table for old would remove those a running job reads."""
    for key in ("zarr.json", "c/0"):
        try:
            return float(fs.modified(f"{path}/{key}").timestamp())
        except FileNotFoundError:
            continue
        except NotImplementedError:
            raise DestinationError(
                f"{path}: this file system ({type(fs).__name__}) does not say when an "
                "object was written, so tidy cannot tell tables replaced long ago from "
                "new ones; nothing was removed"
            ) from None
    return 0.0


def _bytes(fs: Any, path: str) -> int:
    try:
        return int(fs.du(path, total=True))
    except FileNotFoundError:
        return 0


__all__ = ["OLDER_THAN", "TidyReport", "tidy"]
