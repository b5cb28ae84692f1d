"""The store layout, pure: manifest, array geometry, window -> chunk plan.  No I/O.

A zstore store is a Zarr v3 hierarchy: one group per item, one array per dataset.
The root group's attribute ``"zstore"`` holds the manifest's header and names the item
table (see :class:`Manifest` and :mod:`zstore.format._table`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zstore.errors import StoreFormatError
from zstore.format.packs import PackGroup, Placement
from zstore.format.precision import Precision

#: 1: the manifest, every item included, is JSON in the root attributes (with zarr's
#: consolidated metadata beside it).  2: the root attributes hold a header of constant
#: size; names and shapes are in the item table (:mod:`zstore.format._table`).
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
MANIFEST_ATTR = "zstore"
PROGRESS_ATTR = "zstore_convert"
DONE_ATTR = "zstore_complete"
#: an item's checksum of its values, beside its completion mark (zstore.convert._copies)
DIGEST_ATTR = "zstore_digest"
#: Chunks per shard along time: 64 one-second chunks make ~16 MB shards of
#: 8-mic audio -- few objects on S3/NFS, while a shard index stays ~1 KiB.
CHUNKS_PER_SHARD = 64


@dataclass(frozen=True)
class ArrayInfo:
    """What the manifest says about one array name, across items."""

    rate: float | None  # samples per second along the time axis; None: not a time array
    time_axis: int | None
    inferred: bool = False
    dtype: str | None = None  # format 2: every item's dtype of this array
    #: why the converter stored it whole, or the evidence of an inferred rate
    note: str | None = None
    #: Zarr ``dimension_names`` of every item's array (None: written without them)
    dims: tuple[str, ...] | None = None
    #: the stated precision of a float array (None: stored lossless)
    precision: Precision | None = None
    #: a float array's values: ``"int16"``, ``"int24"`` (PCM samples) or ``"float"``
    values: str | None = None


def _array_header(a: ArrayInfo) -> dict[str, Any]:
    out: dict[str, Any] = {
        "rate": a.rate,
        "time_axis": a.time_axis,
        "inferred": a.inferred,
        "dtype": a.dtype,
    }
    if a.note:
        out["note"] = a.note
    if a.dims:
        out["dims"] = list(a.dims)
    if a.precision is not None:
        out["precision"] = a.precision.header()
    if a.values:
        out["values"] = a.values
    return out


def time_lengths(
    arrays: dict[str, ArrayInfo], shapes: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Each time array's length per item: a column of its ``(items, ndim)`` shapes (-1
    where an item lacks it)."""
    return {
        n: shapes[n][:, a.time_axis % shapes[n].shape[1]]
        for n, a in arrays.items()
        if a.rate is not None and n in shapes and shapes[n].shape[1]
    }


@dataclass(frozen=True, eq=False)
class Manifest:
    """The store's table of contents: the root group's ``"zstore"`` attribute, and from
    format 2 on, the item table it names."""

    store_id: str
    arrays: dict[str, ArrayInfo]
    items: Sequence[str]
    lengths: dict[str, np.ndarray]  # time array name -> per-item length (-1: absent)
    codec: str = "lz4"
    chunk_seconds: float = 1.0
    #: Every chunk of every array was written, empty ones included: a missing object
    #: is lost data, never "all fill value".  False only for stores of zstore < 0.2.
    all_chunks_written: bool = False
    #: Arrays that some items lack: name -> positions of the items that have it (an
    #: array absent here is in every item; its ``lengths`` entry is -1 where absent).
    present: dict[str, np.ndarray] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    #: Format 2: per array, every item's shape, ``(items, ndim)``; None for format 1.
    shapes: dict[str, np.ndarray] | None = None
    #: Format 2: the Zarr array that holds the item table.
    table: str | None = None
    #: The pack groups of packed short items (see :mod:`zstore.format.packs`).
    packs: tuple[PackGroup, ...] = ()
    #: Where each item lies: None when every item has its own group.
    placement: Placement | None = None

    def items_with(self, name: str) -> np.ndarray | None:
        """Positions of the items that have array ``name`` (None: every item)."""
        return self.present.get(name)

    def first_index(self, name: str) -> int | None:
        """The position of the first item that has array ``name`` (None: no item has it)."""
        have = self.items_with(name)
        if not len(self.items) or (have is not None and not len(have)):
            return None
        return int(have[0]) if have is not None else 0

    def first_with(self, name: str) -> str | None:
        """The first item that has array ``name`` (None: no item has it)."""
        first = self.first_index(name)
        return None if first is None else self.items[first]

    def position(self, item: str) -> int:
        """The index of item ``item`` (ValueError when there is none)."""
        return self.items.index(item)

    @property
    def time_arrays(self) -> list[str]:
        return [n for n, a in self.arrays.items() if a.rate is not None]

    def header(self) -> dict[str, Any]:
        """The root attribute of a format-2 store: constant size, whatever the items."""
        return {
            "format": FORMAT_VERSION,
            "store_id": self.store_id,
            "arrays": {n: _array_header(a) for n, a in self.arrays.items()},
            "items": len(self.items),
            "table": self.table,
            "codec": self.codec,
            "chunk_seconds": self.chunk_seconds,
            "all_chunks_written": self.all_chunks_written,
            **({"packs": [p.header() for p in self.packs]} if self.packs else {}),
            **self.extra,
        }

    def packed(self, position: int, name: str) -> tuple[PackGroup, int] | None:
        """The pack group and offset of array ``name`` of item ``position``; None when
        the item has its own group."""
        if self.placement is None:
            return None
        found = self.placement.where(position, name)
        return None if found is None else (self.packs[found[0]], found[1])

    @classmethod
    def from_json(
        cls, data: Any, where: str = "store", table: Callable[[str], Any] | None = None
    ) -> Manifest:
        """Parse the root attribute; format 2 reads its item table with ``table(name)``
        (the table's bytes or a map of them)."""
        if not isinstance(data, dict) or "store_id" not in data:
            raise StoreFormatError(
                f"{where} has no zstore manifest; convert it with 'zstore convert' first"
            )
        if data.get("format") not in READABLE_FORMATS:
            raise StoreFormatError(
                f"{where} has manifest format {data.get('format')!r}; this zstore reads "
                f"formats {READABLE_FORMATS}: upgrade zstore"
            )
        try:
            if data["format"] == 1:
                return cls._parse_v1(data)
            common = cls._common(data)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StoreFormatError(
                f"{where}: the zstore manifest in the root zarr.json is damaged ({e!r}); "
                "restore the store's root zarr.json or reconvert it"
            ) from None
        if table is None:
            raise StoreFormatError(f"{where}: format-2 manifest read without its item table")
        from zstore.format._table import unpack

        names, shapes, present, sections = unpack(table(str(data["table"])), where)
        known = {
            "packs",
            "format",
            "store_id",
            "arrays",
            "items",
            "codec",
            "chunk_seconds",
            "all_chunks_written",
            "table",
        }
        return cls.of_table(
            names=names,
            shapes=shapes,
            present=present,
            table=str(data["table"]),
            extra={k: v for k, v in data.items() if k not in known},
            packs=tuple(PackGroup.from_header(p) for p in data.get("packs", ())),
            placement=Placement.of_sections(sections),
            **common,
        )

    @classmethod
    def of_table(
        cls,
        *,
        names: Sequence[str],
        shapes: dict[str, np.ndarray],
        present: dict[str, np.ndarray],
        table: str,
        **rest: Any,
    ) -> Manifest:
        """A format-2 manifest from its item table's contents: time arrays' lengths are
        a column of their shapes, ``present`` (a bool per item) becomes positions."""
        return cls(
            items=names,
            lengths=time_lengths(rest["arrays"], shapes),
            shapes=shapes,
            table=table,
            present={n: np.flatnonzero(v) for n, v in present.items()},
            **rest,
        )

    @staticmethod
    def _common(data: dict[str, Any]) -> dict[str, Any]:
        return dict(
            store_id=str(data["store_id"]),
            arrays={
                n: ArrayInfo(
                    a["rate"],
                    a["time_axis"],
                    bool(a.get("inferred", False)),
                    a.get("dtype"),
                    a.get("note"),
                    tuple(map(str, a["dims"])) if a.get("dims") else None,
                    Precision.from_header(a["precision"]) if a.get("precision") else None,
                    a.get("values"),
                )
                for n, a in data["arrays"].items()
            },
            codec=data.get("codec", "?"),
            chunk_seconds=float(data.get("chunk_seconds", 1.0)),
            all_chunks_written=bool(data.get("all_chunks_written", False)),
        )

    @classmethod
    def _parse_v1(cls, data: dict[str, Any]) -> Manifest:
        known = {
            "format",
            "store_id",
            "arrays",
            "items",
            "lengths",
            "codec",
            "chunk_seconds",
            "all_chunks_written",
            "present",
        }
        from zstore.format._table import names_of

        return cls(
            items=names_of([str(x) for x in data["items"]]),
            lengths={
                n: np.asarray([int(x) for x in v], dtype=np.int64)
                for n, v in data["lengths"].items()
            },
            present={
                n: np.asarray([int(i) for i in v], dtype=np.int64)
                for n, v in data.get("present", {}).items()
            },
            extra={k: v for k, v in data.items() if k not in known},
            **cls._common(data),
        )


#: A chunk holds at least this many bytes: a window of a small array (``act``: 3
#: speakers x 100 frames/s x 4 B = 1.2 kB a second) would otherwise cost one lookup
#: and one codec call per ~1 kB, half of an encoded window's work for 1% of its bytes.
MIN_CHUNK_BYTES = 64_000


def step_nbytes(shape: tuple[int, ...], time_axis: int, itemsize: int) -> int:
    """Bytes of one step along time: every other axis, times the item size."""
    return math.prod(n for a, n in enumerate(shape) if a != time_axis) * itemsize


def chunk_length(
    rate: float, chunk_seconds: float, length: int, sample_bytes: int = MIN_CHUNK_BYTES
) -> int:
    """Time-axis chunk length: about ``chunk_seconds`` at ``rate``, longer where that
    would hold less than :data:`MIN_CHUNK_BYTES` (``sample_bytes``: bytes of one step
    along time, every other axis included), at most the length."""
    return max(1, min(int(chunk_target(rate, chunk_seconds, sample_bytes)), max(1, length)))


def chunk_target(rate: float, chunk_seconds: float, sample_bytes: Any) -> Any:
    """The chunk length :func:`chunk_length` gives an array long enough: about
    ``chunk_seconds`` at ``rate``, at least :data:`MIN_CHUNK_BYTES` (``sample_bytes``:
    an int, or an array of them for many items at once)."""
    return np.maximum(
        int(round(rate * chunk_seconds)), -(-MIN_CHUNK_BYTES // np.maximum(1, sample_bytes))
    )


def shard_length(chunk: int, length: int) -> int:
    """Shard length along time: whole chunks, at most :data:`CHUNKS_PER_SHARD` of them."""
    return chunk * max(1, min(CHUNKS_PER_SHARD, math.ceil(max(1, length) / chunk)))


@dataclass(frozen=True)
class ArrayLayout:
    """Geometry and codecs of one stored array, from its ``zarr.json``.

    ``fast`` is True when :mod:`zstore.read.reader` can read it itself: a regular grid,
    default chunk keys, whole non-time axes, codecs ``bytes`` + blosc/zstd/crc32c,
    optionally inside a ``sharding_indexed`` codec with the index at the end.
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    time_axis: int
    chunk: int  # inner chunk length along time
    shard: int  # shard (stored object) length along time; == chunk when unsharded
    sharded: bool
    separator: str
    codecs: tuple[dict[str, Any], ...]  # bytes-to-bytes codecs, in encoding order
    index_codecs: tuple[dict[str, Any], ...]
    fill_value: Any
    fast: bool
    #: the array's values as the manifest records them (:attr:`ArrayInfo.values`); set
    #: by the reader for items' arrays and pack groups', None where unknown
    values: str | None = None

    @property
    def int16_samples(self) -> bool:
        """Whether this is a float array of int16 samples (:func:`int16_samples`)."""
        return int16_samples(self.dtype, self.values)

    @property
    def ram_dtype(self) -> np.dtype:
        """The dtype of this array's decoded shards in the RAM tier."""
        return np.dtype(np.int16) if self.int16_samples else self.dtype

    @property
    def decoded_tag(self) -> str:
        """What the RAM tier's keys of this array's decoded shards add to their form's
        suffix: ``"f"`` for a float array kept in its own dtype, ``""`` otherwise (int16
        samples; other dtypes).  An append of true-float items widens a store of int16
        samples (``values``): a job opened before it and one opened after then keep
        their forms under keys of their own, instead of dropping each other's as
        corrupt (another size) on every read."""
        return "f" if self.dtype.kind == "f" and not self.int16_samples else ""

    @property
    def length(self) -> int:
        """Its length along time (a scalar, stored whole, has none: 0)."""
        return self.shape[self.time_axis] if self.shape else 0

    @property
    def chunks_per_shard(self) -> int:
        return self.shard // self.chunk

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        s = list(self.shape)
        s[self.time_axis] = self.chunk
        return tuple(s)

    @property
    def step_nbytes(self) -> int:
        """Bytes of one step along time (every other axis)."""
        return step_nbytes(self.shape, self.time_axis, self.dtype.itemsize)

    @functools.cached_property
    def chunk_nbytes(self) -> int:
        """Bytes of one decoded inner chunk."""
        return math.prod(self.chunk_shape) * self.dtype.itemsize

    @property
    def index_bytes(self) -> int:
        checksum = 4 if any(c["name"] == "crc32c" for c in self.index_codecs) else 0
        return 16 * self.chunks_per_shard + checksum

    def object_key(self, shard_index: int) -> str:
        coords = ["0"] * len(self.shape)
        coords[self.time_axis] = str(shard_index)
        return f"{self.path}/c{self.separator}{self.separator.join(coords)}"

    def chunks_for(self, start: int, stop: int) -> range:
        """Inner chunk numbers along time that ``[start, stop)`` overlaps."""
        if stop <= start:
            return range(0)
        return range(start // self.chunk, (stop - 1) // self.chunk + 1)


def int16_samples(dtype: np.dtype, values: str | None) -> bool:
    """Whether an array of ``dtype`` whose values are ``values`` (the manifest's) is a
    float array of int16 samples (``x / 32768``, as read from 16-bit PCM): the RAM tier
    keeps its decoded shards as the int16 samples, half (float32) or a quarter (float64)
    of the bytes, widened back exactly as a window is copied out
    (:attr:`ArrayLayout.ram_dtype`)."""
    return values == "int16" and dtype.kind == "f" and dtype.itemsize > 2


def parse_array_meta(
    path: str, meta: dict[str, Any], time_axis: int | None, values: str | None = None
) -> ArrayLayout:
    """Build an :class:`ArrayLayout` from a Zarr v3 array ``zarr.json`` document (and
    the manifest's ``values`` of the array, where the caller has them)."""
    shape = tuple(int(x) for x in meta["shape"])
    ndim = len(shape)
    axis = (time_axis if time_axis is not None else -1) % max(ndim, 1) if ndim else 0
    grid = meta.get("chunk_grid", {})
    outer = tuple(grid.get("configuration", {}).get("chunk_shape", shape))
    keys = meta.get("chunk_key_encoding", {})
    separator = keys.get("configuration", {}).get("separator", "/")
    codecs = list(meta.get("codecs", []))
    fast = grid.get("name") == "regular" and keys.get("name") == "default" and ndim > 0
    sharded = bool(codecs) and codecs[0]["name"] == "sharding_indexed"
    index_codecs: list[dict[str, Any]] = []
    inner = outer
    if sharded:
        cfg = codecs[0]["configuration"]
        inner = tuple(cfg["chunk_shape"])
        index_codecs = list(cfg.get("index_codecs", []))
        fast = fast and len(codecs) == 1 and cfg.get("index_location", "end") == "end"
        fast = fast and [c["name"] for c in index_codecs] in (["bytes"], ["bytes", "crc32c"])
        codecs = list(cfg["codecs"])
    fast = fast and bool(codecs) and codecs[0]["name"] == "bytes"
    fast = fast and all(c["name"] in ("blosc", "zstd", "crc32c") for c in codecs[1:])
    endian = codecs[0].get("configuration", {}).get("endian", "little") if codecs else "little"
    dtype = np.dtype(meta["data_type"]) if isinstance(meta.get("data_type"), str) else None
    fast = fast and dtype is not None and (endian == "little" or dtype.itemsize == 1)
    fast = fast and all(inner[a] >= shape[a] for a in range(ndim) if a != axis)
    return ArrayLayout(
        path=path,
        shape=shape,
        dtype=dtype if dtype is not None else np.dtype("V1"),
        time_axis=axis,
        chunk=int(inner[axis]) if ndim else 1,
        shard=int(outer[axis]) if ndim else 1,
        sharded=sharded,
        separator=separator,
        codecs=tuple(codecs[1:]),
        index_codecs=tuple(index_codecs),
        fill_value=meta.get("fill_value", 0),
        fast=bool(fast),
        values=values,
    )


@dataclass(frozen=True)
class Span:
    """A window on one array: ``[start, stop)`` along time, ``pad`` zeros after it."""

    start: int
    stop: int
    pad: int = 0


def scale(frames: int, coarse_rate: float, rate: float) -> int:
    """Convert a position on the coarsest grid to the grid of ``rate`` (exact for integer ratios)."""
    ratio = rate / coarse_rate
    if float(ratio).is_integer():
        return frames * int(ratio)
    return int(math.floor(frames * ratio + 1e-9))


def geometry(
    shape: tuple[int, ...],
    rate: float | None,
    time_axis: int | None,
    chunk_seconds: float,
    itemsize: int,
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Chunk and shard shape of an array as the converter writes it."""
    if rate is None or not shape:
        return tuple(max(1, s) for s in shape), None
    axis = (time_axis if time_axis is not None else -1) % len(shape)
    chunk, shard = list(shape), list(shape)
    chunk[axis] = chunk_length(rate, chunk_seconds, shape[axis], step_nbytes(shape, axis, itemsize))
    shard[axis] = shard_length(chunk[axis], shape[axis])
    return tuple(max(1, c) for c in chunk), tuple(max(1, s) for s in shard)
