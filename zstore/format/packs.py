"""Packed short items: many items' arrays concatenated along time in shared arrays.

A store of short utterances (0.1-10 s) as one Zarr group per item costs an object per
array per item and a directory per item: ~5 objects and ~48 KB of disk blocks for an
item of 20 KB.  Items whose every array is a time array no longer than the store's
``pack_seconds`` are instead stored as spans of shared arrays, one Zarr group per *pack
group* (items with the same arrays, dtypes and other axes)::

    zstore_packed/<g>/<array>          a sharded Zarr v3 array, items back to back in time
    zstore_packed/<g>/items.<b>.json   batch ``b``'s record: its items and attributes

Items are written in batches; every batch starts each array on a fresh shard, so
batches never share a stored object (they are written in parallel, and an append adds
shards without rewriting any).  The zeros between a batch's last item and the next
shard boundary belong to no item.  The item table records per item its pack group,
its batch and, per array, its offset along time; its length is its shape, as for any
item.  Item ``i`` of array ``wav`` is ``zstore_packed/<g>/wav[..., o:o+n]`` with ``o``
its offset and ``n`` its length: readable by any Zarr v3 reader.  Pure: no I/O.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

PACKED_ROOT = "zstore_packed"
#: Items no longer than this (every time array) are packed by default: one item's own
#: group costs ~48 KB of disk blocks and 5 objects (12 inodes), the stored bytes of
#: ~1.5 s of mono float32 audio; at 10 s the overhead is still ~15%.
PACK_SECONDS = 10.0
#: A packed chunk holds at least this many bytes: small arrays (``act``: 800 B a second)
#: get chunks of ~10 s, not the ~64 KB of an item's own chunk, so a 0.5 s item decodes
#: ~10 s of activity at most.
PACKED_MIN_CHUNK_BYTES = 8_000
#: An item whose arrays stored whole (a scalar label, an embedding) hold at most this
#: many bytes each is packed, those arrays kept in its batch's record
#: (:func:`record_array`); an item with a larger one keeps its own group.
PACKED_WHOLE_BYTES = 4096


def packed_geometry(
    shape: tuple[int, ...], rate: float, time_axis: int, chunk_seconds: float, itemsize: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Chunk and shard shape of a packed array: chunks of ``chunk_seconds`` (at least
    :data:`PACKED_MIN_CHUNK_BYTES`), shards of ~``CHUNKS_PER_SHARD x chunk_seconds``
    for every array of a group alike."""
    from zstore.format.layout import CHUNKS_PER_SHARD, step_nbytes  # layout imports this module

    axis = time_axis % len(shape)
    step = step_nbytes(shape, axis, itemsize)
    chunk = max(1, int(round(rate * chunk_seconds)), -(-PACKED_MIN_CHUNK_BYTES // max(1, step)))
    per_shard = max(1, int(round(CHUNKS_PER_SHARD * chunk_seconds * rate / chunk)))
    chunks, shards = list(shape), list(shape)
    chunks[axis], shards[axis] = chunk, chunk * per_shard
    return tuple(max(1, c) for c in chunks), tuple(max(1, s) for s in shards)


def signature(
    shapes: dict[str, tuple[int, ...]], dtypes: dict[str, Any], axes: dict[str, int]
) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """What items of one pack group share: per array, its dtype and its shape with the
    time axis left out (as -1)."""
    out = []
    for name in sorted(shapes):
        shape = list(shapes[name])
        shape[axes[name] % len(shape)] = -1
        out.append((name, np.dtype(dtypes[name]).str, tuple(shape)))
    return tuple(out)


@dataclass(frozen=True)
class PackGroup:
    """One pack group: where its arrays are, their dtypes and shapes (time: every
    batch's shards so far), and how many batches it holds."""

    path: str
    dtypes: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    batches: int

    def header(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "arrays": {
                n: {"dtype": self.dtypes[n], "shape": list(s)} for n, s in self.shapes.items()
            },
            "batches": self.batches,
        }

    @classmethod
    def from_header(cls, data: dict[str, Any]) -> PackGroup:
        arrays = data["arrays"]
        return cls(
            path=str(data["path"]),
            dtypes={n: str(a["dtype"]) for n, a in arrays.items()},
            shapes={n: tuple(int(x) for x in a["shape"]) for n, a in arrays.items()},
            batches=int(data["batches"]),
        )

    def array_path(self, name: str) -> str:
        return f"{self.path}/{name}"

    def record_key(self, batch: int) -> str:
        """The batch's record: its items and their attributes, written last."""
        return f"{self.path}/items.{batch}.json"

    def key(self, axes: dict[str, int]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        return signature(self.shapes, self.dtypes, axes)


@dataclass(frozen=True, eq=False)
class Placement:
    """Where each item of a store lives: ``group`` (-1: its own Zarr group), ``batch``,
    and per array ``offsets`` along time in its pack group's array (-1: not packed)."""

    group: np.ndarray
    batch: np.ndarray
    offsets: dict[str, np.ndarray]

    def sections(self) -> dict[str, np.ndarray]:
        """The item table's sections for it."""
        out = {"pack/group": self.group.astype("<i4"), "pack/batch": self.batch.astype("<i4")}
        out.update({f"offset/{n}": v.astype("<i8") for n, v in self.offsets.items()})
        return out

    @classmethod
    def of_sections(cls, sections: dict[str, np.ndarray]) -> Placement | None:
        if "pack/group" not in sections:
            return None
        return cls(
            group=sections["pack/group"],
            batch=sections["pack/batch"],
            offsets={
                k[len("offset/") :]: v for k, v in sections.items() if k.startswith("offset/")
            },
        )

    @classmethod
    def unpacked(cls, n: int, names: list[str]) -> Placement:
        """Every item in its own group."""
        return cls(
            group=np.full(n, -1, dtype=np.int32),
            batch=np.full(n, -1, dtype=np.int32),
            offsets={name: np.full(n, -1, dtype=np.int64) for name in names},
        )

    @classmethod
    def joined(cls, first: Placement, second: Placement) -> Placement:
        names = sorted(set(first.offsets) | set(second.offsets))

        def col(p: Placement, name: str) -> np.ndarray:
            return p.offsets.get(name, np.full(len(p.group), -1, dtype=np.int64))

        return cls(
            group=np.concatenate([first.group, second.group]).astype(np.int32),
            batch=np.concatenate([first.batch, second.batch]).astype(np.int32),
            offsets={n: np.concatenate([col(first, n), col(second, n)]) for n in names},
        )

    def packed_count(self) -> int:
        return int((self.group >= 0).sum())

    def where(self, position: int, name: str) -> tuple[int, int] | None:
        """(pack group, offset) of ``name`` of item ``position``; None: its own group.
        The offset is -1 for an array not in the pack group's arrays (absent, or
        stored whole in the batch's record)."""
        g = int(self.group[position])
        if g < 0:
            return None
        offsets = self.offsets.get(name)
        return g, -1 if offsets is None else int(offsets[position])


def record_array(values: list[tuple[int, np.ndarray]]) -> dict[str, Any]:
    """How a batch's record keeps an array stored whole for its items: ``values`` are
    (the item's index in the record's ``items``, its value).  Readable without zstore:
    ``data`` is the base64 of the values' little-endian bytes, back to back in the order
    of ``items``, each of its ``shapes`` entry and of ``dtype``."""
    values = sorted(values, key=lambda kv: kv[0])  # in the order of the record's items
    dtype = np.dtype(values[0][1].dtype).newbyteorder("<")
    parts = [np.array(v, dtype=dtype, order="C") for _, v in values]  # 0-d kept 0-d
    return {
        "dtype": dtype.str,
        "items": [k for k, _ in values],
        "shapes": [list(v.shape) for v in parts],
        "data": base64.b64encode(b"".join(p.tobytes() for p in parts)).decode("ascii"),
    }


def record_values(entry: dict[str, Any]) -> dict[int, np.ndarray]:
    """The values a record keeps for one array (:func:`record_array`), by the item's
    index in the record (native byte order, each its own array)."""
    dtype = np.dtype(entry["dtype"])
    data = base64.b64decode(entry["data"])
    out: dict[int, np.ndarray] = {}
    at = 0
    for k, shape in zip(entry["items"], entry["shapes"]):
        n = math.prod(shape) * dtype.itemsize
        value = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=at)
        out[int(k)] = value.reshape(shape).astype(dtype.newbyteorder("="))
        at += n
    if at != len(data):
        raise ValueError(f"{len(data) - at} bytes more than the shapes hold")
    return out


def shards_for(length: int, shard: int) -> int:
    """Shards a batch's ``length`` samples take (whole shards, none for nothing)."""
    return math.ceil(length / shard) if length > 0 else 0


def packed_meta(group: PackGroup, name: str, info: Any, codec: str, chunk_seconds: float) -> dict:
    """The ``zarr.json`` document of a pack group's array ``name`` (``info``: its
    :class:`~zstore.format.layout.ArrayInfo`), as the converter writes it."""
    from zstore.format.objects import array_meta
    from zstore.format.precision import PRECISION_ATTR, effective_bits

    shape, dtype = group.shapes[name], np.dtype(group.dtypes[name])
    chunks, shards = packed_geometry(
        shape, info.rate, info.time_axis, chunk_seconds, dtype.itemsize
    )
    attrs: dict[str, Any] = {"zstore": PACKED_NOTE}
    if info.precision is not None and effective_bits(info.precision, dtype) is not None:
        attrs[PRECISION_ATTR] = info.precision.attribute()
    return array_meta(shape, dtype, chunks, shards, codec, attrs, info.dims)


PACKED_NOTE = (
    "packed short items, back to back along time; each item's offset and length are in "
    "the store's item table (zstore info, or zstore.open_store)"
)
