"""Which append wrote an object of a store: its place in the cache's key space.

The node cache keys every object by the store id, which an append keeps, so that the
chunks of the items it did not write stay valid.  But a store's id is shared by every
copy of it (``cp -r``, ``aws s3 sync``) and by the store restored from a backup; an
append to one of them writes *other* data at paths another may hold too: items of the
same names, and packed items in the same new shards and batch records.  Keyed by the
store id alone, a node cache shared by jobs reading two such stores served one's
chunks for the other's.

So each append records an id of its own in the manifest header (``"appends"``, in
order) with where its objects begin: its first item's position, per packed array its
first new shard, per pack group its first new batch.  An object an append wrote is
keyed under that append's id (:meth:`Lineage.of`); the conversion's objects keep the
store id alone, so appends leave every cached chunk of the items before them valid.
Stores appended to by zstore before this record have no entries: their appended
objects keep the store id alone, as before.  Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zstore.format.layout import Manifest
from zstore.format.packs import PACKED_ROOT

#: the manifest header's key of the appends' records
APPENDS = "appends"
#: an array object's chunk key or metadata below the array's path: ``c/0/5``, ``c.0.5``
#: (the separator), ``c`` (a scalar), ``zarr.json``
_BELOW_ARRAY = re.compile(r"/(?:zarr\.json|c(?:[./]\d+)*)$")
_RECORD = re.compile(r"items\.(\d+)\.json")
#: a chunk object's key below its array: ``c``, ``c/0/5``, ``c.0.5``
_CHUNK = re.compile(r"c(?:[./]\d+)*")
#: positions of items this many a process remembers (past it, it forgets them all)
MAX_ITEMS = 65536


@dataclass(frozen=True)
class Append:
    """One append's record: its id and where its objects begin."""

    id: str
    items: int  # the position of its first item
    shards: dict[str, int] = field(default_factory=dict)  # packed array path -> first shard
    batches: dict[str, int] = field(default_factory=dict)  # pack group path -> first batch

    def header(self) -> dict[str, Any]:
        """Its record in the header (the root, read beside every round of origin reads:
        kept short, the packed parts only where it wrote some)."""
        packed = {"shards": self.shards, "batches": self.batches} if self.batches else {}
        return {"id": self.id, "items": self.items, **packed}

    @classmethod
    def from_header(cls, data: Mapping[str, Any]) -> Append:
        return cls(
            id=str(data["id"]),
            items=int(data["items"]),
            shards={str(k): int(v) for k, v in data.get("shards", {}).items()},
            batches={str(k): int(v) for k, v in data.get("batches", {}).items()},
        )


def appends_of(extra: Mapping[str, Any]) -> list[Append]:
    """The appends a manifest's header records (``Manifest.extra``), in order."""
    return [Append.from_header(a) for a in extra.get(APPENDS, ())]


def append_ids(header: Mapping[str, Any]) -> list[str]:
    """The ids of the appends a manifest header (or ``Manifest.extra``) records."""
    return [str(a["id"]) for a in header.get(APPENDS, ())]


def recorded(
    extra: Mapping[str, Any],
    new_id: str,
    first_item: int,
    batches: Iterable[tuple[str, int, Mapping[str, int]]],
) -> list[dict[str, Any]]:
    """The header's ``"appends"`` with a new append's record after the others: its id,
    its first item's position, and from its packed ``batches`` (group path, batch
    number, per array its first shard) the first of each."""
    shards: dict[str, int] = {}
    firsts: dict[str, int] = {}
    for group, number, starts in batches:
        firsts[group] = min(firsts.get(group, number), number)
        for name, start in starts.items():
            path = f"{group}/{name}"
            shards[path] = min(shards.get(path, start), start)
    entry = Append(new_id, first_item, shards, firsts)
    return [a.header() for a in appends_of(extra)] + [entry.header()]


class Lineage:
    """Per object of a store, the id of the append that wrote it ("" for the
    conversion's, and for every object of a store no append of this zstore wrote to).

    ``position(item)`` is the item's position in the manifest (ValueError for a name
    that is not an item); ``time_axes`` per array name its time axis (packed arrays)."""

    def __init__(
        self,
        appends: list[Append],
        position: Callable[[str], int],
        time_axes: Mapping[str, int | None],
    ):
        self.appends = appends
        self._position = position
        self._axes = dict(time_axes)
        self._items: dict[str, str | None] = {}  # prefix -> append id (None: no item)

    def __call__(self, key: str) -> str:
        return self.of(key)

    def of(self, key: str) -> str:
        """The id of the append that wrote the object a cache ``key`` starts with (the
        object's path in the store, then anything after a ``#``)."""
        if not self.appends:
            return ""
        path = key.split("#", 1)[0]
        if path.startswith(PACKED_ROOT + "/"):
            return self._packed(path)
        for cut in _item_cuts(path):
            found = self._item(path[:cut])
            if found is not None:
                return found
        return ""

    def _item(self, prefix: str) -> str | None:
        """The append id of item ``prefix``, or None when no item has that name."""
        if prefix in self._items:
            return self._items[prefix]
        try:
            at = self._position(prefix)
        except ValueError:
            found = None
        else:
            found = next((a.id for a in reversed(self.appends) if at >= a.items), "")
        if len(self._items) >= MAX_ITEMS:
            self._items.clear()
        self._items[prefix] = found
        return found

    def _packed(self, path: str) -> str:
        """A pack group's object: a batch record by its batch, a chunk object by its
        shard along time, an array's metadata by the last append that grew it."""
        parts = path.split("/", 3)  # zstore_packed, group, array or record, below
        if len(parts) < 3:
            return ""
        group = f"{parts[0]}/{parts[1]}"
        record = _RECORD.fullmatch(parts[2])
        if record is not None:
            batch = int(record.group(1))
            return _last(self.appends, lambda a: a.batches.get(group), batch)
        array = f"{group}/{parts[2]}"
        below = parts[3] if len(parts) > 3 else ""
        if not _CHUNK.fullmatch(below):  # its zarr.json
            return next((a.id for a in reversed(self.appends) if array in a.shards), "")
        coords = below[2:].replace(".", "/").split("/") if len(below) > 1 else []
        if not coords:
            return ""
        axis = self._axes.get(parts[2])
        shard = int(coords[(-1 if axis is None else axis) % len(coords)])
        return _last(self.appends, lambda a: a.shards.get(array), shard)


def _last(appends: list[Append], first: Callable[[Append], int | None], at: int) -> str:
    """The id of the last append whose first (``first(append)``) is at or before ``at``."""
    for a in reversed(appends):
        start = first(a)
        if start is not None and at >= start:
            return a.id
    return ""


def _item_cuts(path: str) -> list[int]:
    """Where an item's name may end in an object ``path``, longest first: before the
    array below it (``<item>/<array>/c/0/5``, ``<item>/<array>/zarr.json``) or before a
    group's own ``zarr.json``."""
    m = _BELOW_ARRAY.search(path)
    if m is None:
        return []
    cuts = [m.start()] if path.endswith("/zarr.json") else []
    array_at = path.rfind("/", 0, m.start())
    if array_at > 0:
        cuts.append(array_at)
    return cuts


def lineage_of(manifest: Manifest) -> Lineage | None:
    """The lineage of a store's objects, or None when no append recorded one."""
    appends = appends_of(manifest.extra)
    if not appends:
        return None
    axes = {n: a.time_axis for n, a in manifest.arrays.items()}
    return Lineage(appends, manifest.position, axes)


def cache_namespace(store_id: str, header: Mapping[str, Any]) -> str:
    """The namespace of a store read without its item table (zarr's API through
    :class:`zstore.read.CachedStore`): the store id, and the last append's id once
    there is one, so each append starts that namespace anew."""
    ids = append_ids(header)
    return f"{store_id}.{ids[-1]}" if ids else store_id


__all__ = [
    "APPENDS",
    "Append",
    "Lineage",
    "append_ids",
    "appends_of",
    "cache_namespace",
    "lineage_of",
    "recorded",
]
