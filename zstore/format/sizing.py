"""How much a store's fields take: decoded and stored bytes, shard and chunk counts.

From the manifest (lengths) and the first item's array metadata (the other axes,
dtype, chunking), so it costs nothing per item beyond a sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zstore.format.layout import Manifest, geometry, int16_samples, parse_array_meta


@dataclass(frozen=True)
class Sizes:
    """Totals over every item for the fields asked for."""

    decoded_bytes: int
    stored_bytes: int
    shards: int
    chunks: int
    #: what the decoded fields take in the RAM tier: float arrays of int16 samples are
    #: kept as int16 there (``ArrayLayout.ram_dtype``)
    ram_bytes: int = 0


def _totals(lengths: np.ndarray, step_nbytes: int, chunk: int, shard: int) -> list[int]:
    """[decoded bytes, shards, chunks] of an array over the items of ``lengths`` (-1 where
    an item lacks it)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths >= 0]
    return [
        step_nbytes * int(lengths.sum()),
        int((-(-lengths // max(1, shard))).sum()),
        int((-(-lengths // max(1, chunk))).sum()),
    ]


def array_totals(
    arrays: dict[str, Any],
    shapes: dict[str, np.ndarray],
    lengths: dict[str, np.ndarray],
    chunk_seconds: float,
) -> dict[str, list[int]]:
    """Per time array (``lengths``: its length per item), [decoded bytes, shards, chunks]
    over every item, with the first item's chunking as the converter writes it (what
    :func:`field_sizes` derives from its metadata); kept in a format-2 header, so opening
    a store does not sum every item's length."""

    out = {}
    for name, column in lengths.items():
        info, rows = arrays[name], shapes[name]
        if info.dtype is None:
            continue
        have = np.flatnonzero(column >= 0)
        if not len(have):
            continue
        first = tuple(int(x) for x in rows[have[0]])
        axis = info.time_axis % len(first)
        try:
            itemsize = np.dtype(info.dtype).itemsize
        except TypeError:
            continue  # a dtype numpy does not name: field_sizes reads the metadata
        chunks, shards = geometry(first, info.rate, axis, chunk_seconds, itemsize)
        step = int(np.prod([s for i, s in enumerate(first) if i != axis])) * itemsize
        shard = shards[axis] if shards is not None and first[axis] else 1
        out[name] = _totals(column, step, chunks[axis], shard)
    return out


def field_sizes(manifest: Manifest, metas: Any, fields: Sequence[str] | None = None) -> Sizes:
    """Decoded and (estimated) stored bytes, shards and chunks of ``fields`` (default:
    every time array).  Stored bytes are the store's bytes in proportion to the fields'
    share of the decoded bytes (the manifest does not split them by array).  From the
    header's totals where it has them, else summed over every item's length."""
    names = [n for n in (fields or manifest.time_arrays) if n in manifest.lengths]
    decoded = shards = chunks = 0
    everything = ram = 0
    known = manifest.extra.get("sizes")
    known = known if isinstance(known, dict) else {}
    for name in manifest.time_arrays:
        if name in known:
            totals = [int(x) for x in known[name]]
        else:
            first = manifest.first_index(name)
            meta = metas.at(first, name) if first is not None else None
            if meta is None:
                continue
            layout = parse_array_meta(name, meta, manifest.arrays[name].time_axis)
            totals = _totals(
                manifest.lengths[name],
                layout.step_nbytes,
                layout.chunk,
                layout.shard if layout.length else 1,
            )
        everything += totals[0]
        if name in names:
            decoded += totals[0]
            ram += int(totals[0] * _ram_share(manifest, name))
            shards += totals[1]
            chunks += totals[2]
    total = int(manifest.extra.get("store_bytes", 0))
    stored = int(total * decoded / everything) if everything else total
    return Sizes(decoded, stored, shards, chunks, ram)


def _ram_share(manifest: Manifest, name: str) -> float:
    """The share of array ``name``'s decoded bytes its shards take in the RAM tier: 0.5
    for float32 int16 samples (0.25 for float64), 1 otherwise."""
    info = manifest.arrays[name]
    if info.dtype is None:
        return 1.0
    dtype = np.dtype(info.dtype)
    return 2 / dtype.itemsize if int16_samples(dtype, info.values) else 1.0


def stored_objects(manifest: Manifest) -> int:
    """The objects a format-2 store holds (files on a local path, objects on S3; not
    directories): the root's two and the item table's, each own item's group, arrays and
    shards, and each pack group's metadata, shards and batch records."""
    from zstore.format.layout import CHUNKS_PER_SHARD, chunk_target
    from zstore.format.packs import packed_geometry

    if manifest.shapes is None:
        return 0
    n = len(manifest.items)
    own = np.ones(n, dtype=bool)
    if manifest.placement is not None:
        own = manifest.placement.group < 0
    total = 3 + int(own.sum())  # root zarr.json, the table's two objects; item groups
    parents: set[str] = (
        set()
    )  # the groups above nested items (``spk/rec9``): Zarr v3 has no implicit ones
    for i in np.flatnonzero(own):
        parts = manifest.items[int(i)].split("/")[:-1]
        parents.update("/".join(parts[: k + 1]) for k in range(len(parts)))
    total += len(parents)
    for name, rows in manifest.shapes.items():
        info = manifest.arrays[name]
        have = own & (rows.min(axis=1) >= 0) if rows.shape[1] else own & False
        if not have.any():
            continue
        rows = rows[have]
        total += len(rows)  # each array's zarr.json
        if info.rate is None or info.time_axis is None or info.dtype is None:
            total += int((rows.prod(axis=1) > 0).sum())  # one chunk, unless empty
            continue
        axis = info.time_axis % rows.shape[1]
        length = rows[:, axis]
        step = np.delete(rows, axis, axis=1).prod(axis=1) * np.dtype(info.dtype).itemsize
        # geometry()'s shards: one while the item is at most CHUNKS_PER_SHARD chunks of
        # the target length (its chunk is clamped to the item), else that many per shard
        per_shard = CHUNKS_PER_SHARD * np.maximum(
            1, chunk_target(info.rate, manifest.chunk_seconds, step)
        )
        total += int(np.where(length * step > 0, -(-length // per_shard), 0).sum())
    for group in manifest.packs:
        total += 1 + group.batches  # the group's zarr.json, its records
        for name, shape in group.shapes.items():
            info = manifest.arrays[name]
            assert info.rate is not None and info.time_axis is not None  # packed: time arrays
            _, shards = packed_geometry(
                shape,
                info.rate,
                info.time_axis,
                manifest.chunk_seconds,
                np.dtype(group.dtypes[name]).itemsize,
            )
            axis = info.time_axis % len(shape)
            total += 1 + shape[axis] // shards[axis]
    if manifest.packs:
        total += 1  # zstore_packed/zarr.json
    return total
