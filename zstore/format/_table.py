"""The item table: names and array shapes of every item, in one binary object.

A store of a million items cannot keep them in its root ``zarr.json`` (JSON that every
process parses, ~1.7 KB per item with zarr's consolidated metadata).  The table holds
what a reader needs per item -- its name, each array's shape, and for arrays some items
lack, which items have them -- as raw little-endian arrays that a process maps and indexes
without parsing: ~16 bytes per array per item plus the name.  Layout:

    b"ZSTABLE1" | u64 header length | header (JSON) | sections, each 64-byte aligned

The header names each section's offset, dtype and shape.  The table is stored as the
one chunk of a 1-D ``uint8`` Zarr array (no codecs), so zarr sees a normal hierarchy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from zstore.errors import StoreFormatError

MAGIC = b"ZSTABLE1"
ALIGN = 64


class Names(Sequence[str]):
    """Item names decoded on access from a mapped blob; ``index`` is a binary search
    over the stored sort order, so no process builds a dict of every name."""

    def __init__(self, blob: np.ndarray, offsets: np.ndarray, order: np.ndarray):
        self._blob, self._offsets, self._order = blob, offsets, order
        # memoryviews: a name by index in ~0.5 us (~0.9 through numpy scalars)
        raw, starts = np.ascontiguousarray(blob, np.uint8), np.ascontiguousarray(offsets, np.int64)
        self._bytes = memoryview(raw.data).cast("B")
        self._starts = memoryview(starts.data).cast("B").cast("q")

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"item {i} out of range for {n} items")
        i %= n
        return str(self._bytes[self._starts[i] : self._starts[i + 1]], "utf-8")

    def __iter__(self) -> Iterator[str]:
        text = bytes(self._blob).decode()
        offsets = self._offsets.tolist()
        if len(text) == len(self._blob):  # ASCII: byte and character offsets agree
            return (text[a:b] for a, b in zip(offsets, offsets[1:]))
        return (self[i] for i in range(len(self)))

    def _raw(self, i: int) -> bytes:
        return bytes(self._blob[int(self._offsets[i]) : int(self._offsets[i + 1])])

    def index(self, name: Any, start: int = 0, stop: int | None = None) -> int:
        if not isinstance(name, str):
            raise ValueError(f"{name!r} is not an item")
        key = name.encode()
        lo, hi = 0, len(self._order)
        while lo < hi:  # the order sorts names as UTF-8 bytes
            mid = (lo + hi) // 2
            if self._raw(int(self._order[mid])) < key:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(self._order) and self._raw(int(self._order[lo])) == key:
            return int(self._order[lo])
        raise ValueError(f"{name!r} is not an item")

    def __contains__(self, name: object) -> bool:
        try:
            self.index(name)
        except ValueError:
            return False
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"Names({len(self)} items)"


def pack(
    names: Sequence[str],
    shapes: dict[str, np.ndarray],
    present: dict[str, np.ndarray] | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> bytes:
    """The table of ``names``, per-array ``(items, ndim)`` int64 shapes, for arrays
    some items lack, which have it (bool per item), and ``extra`` sections of one value
    per item (where packed items lie, :class:`zstore.format.packs.Placement`)."""
    encoded = [n.encode() for n in names]
    offsets = np.zeros(len(encoded) + 1, dtype="<i8")
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    order = np.asarray(sorted(range(len(encoded)), key=encoded.__getitem__), dtype="<i8")
    sections: dict[str, np.ndarray] = {
        "names": np.frombuffer(b"".join(encoded), dtype=np.uint8),
        "offsets": offsets,
        "order": order,
    }
    for name, rows in shapes.items():
        rows = np.asarray(rows, dtype="<i8")
        if rows.ndim != 2 or rows.shape[0] != len(names):
            raise ValueError(f"shapes of '{name}' must be (items, ndim)")
        sections[f"shape/{name}"] = rows
    for name, have in (present or {}).items():
        sections[f"present/{name}"] = np.asarray(have, dtype=np.uint8)
    for key, column in (extra or {}).items():
        if len(column) != len(names):
            raise ValueError(f"section '{key}' must have one value per item")
        sections[key] = np.ascontiguousarray(column)
    header: dict[str, Any] = {"items": len(names), "sections": {}}
    pos = 0
    for key, arr in sections.items():
        header["sections"][key] = [pos, arr.dtype.str, list(arr.shape)]
        pos += -(-arr.nbytes // ALIGN) * ALIGN
    head = json.dumps(header).encode()
    start = -(-(len(MAGIC) + 8 + len(head)) // ALIGN) * ALIGN
    out = bytearray(start + pos)
    out[:8] = MAGIC
    out[8:16] = len(head).to_bytes(8, "little")
    out[16 : 16 + len(head)] = head
    for key, arr in sections.items():
        off = start + header["sections"][key][0]
        out[off : off + arr.nbytes] = arr.tobytes()
    return bytes(out)


def names_of(names: Sequence[str]) -> Names:
    """A :class:`Names` of a list (a format-1 manifest's), so every store looks names up
    the same way."""
    return unpack(pack(names, {}), "names")[0]


def unpack(
    buf: Any, where: str
) -> tuple[Names, dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Names, shapes, presence (bool per item, for arrays some items lack) and the other
    sections, as views into ``buf`` (bytes or a read-only map)."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    try:
        if bytes(raw[:8]) != MAGIC:
            raise ValueError("not an item table")
        size = int.from_bytes(bytes(raw[8:16]), "little")
        header = json.loads(bytes(raw[16 : 16 + size]))
        start = -(-(16 + size) // ALIGN) * ALIGN
        views = {}
        for key, (off, dtype, shape) in header["sections"].items():
            dt = np.dtype(dtype)
            count = int(np.prod(shape))
            views[key] = np.frombuffer(raw, dtype=dt, count=count, offset=start + off).reshape(
                shape
            )
        names = Names(views["names"], views["offsets"], views["order"])
        if len(names) != header["items"]:
            raise ValueError("item count disagrees with the header")
    except (ValueError, KeyError, TypeError) as e:
        raise StoreFormatError(
            f"{where}: the item table is damaged ({e}); restore the store's "
            "root objects from a good copy or reconvert it"
        ) from None
    shapes = {k[len("shape/") :]: v for k, v in views.items() if k.startswith("shape/")}
    present = {
        k[len("present/") :]: v.astype(bool) for k, v in views.items() if k.startswith("present/")
    }
    extra = {
        k: v
        for k, v in views.items()
        if k not in ("names", "offsets", "order")
        and not k.startswith("shape/")
        and not k.startswith("present/")
    }
    return names, shapes, present, extra
