"""Packing short items (see :mod:`zstore.format.packs`): which items are packed, into
which pack group and batch, at which offsets; writing a batch's shards and its record;
checking a batch against the source on ``--verify``.

The plan is made in the converting process from the scan alone (item shapes), so it is
the same on a rerun: a batch whose record names the same items (and, for an append,
the same source versions) is done; any other is written again, whole.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zstore.convert._copies import checked_digest, item_digest
from zstore.convert._items import Job, compare_values, verify_all, write_missing
from zstore.convert._read import read_items
from zstore.convert._source import SourceItem, SourcePlan
from zstore.convert._tasks import Progress, run_batches
from zstore.convert._values import Tally, prepared, stored_values
from zstore.errors import SourceError
from zstore.format import (
    PACKED_ROOT,
    PACKED_WHOLE_BYTES,
    ArrayInfo,
    ObjectWriter,
    PackGroup,
    Placement,
    dumps,
    encode_array,
    group_meta,
    handles,
    packed_geometry,
    packed_meta,
    record_array,
    shards_for,
    signature,
    step_nbytes,
)

#: A batch holds at most this many shards of each array and this many decoded bytes (its
#: arrays are assembled in memory), and at most this many items.
BATCH_SHARDS, BATCH_BYTES, BATCH_ITEMS = 4, 64 * 2**20, 4096


@dataclass
class PackBatch:
    """One task: items of one pack group written into whole shards of its arrays."""

    group: int
    number: int
    items: list[SourceItem]
    starts: dict[str, int]  # per array, the batch's first shard
    shards: dict[str, int]  # per array, how many shards it takes
    offsets: list[dict[str, int]]  # per item, per array: its offset in the pack's array

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[SourceItem]:
        return iter(self.items)


@dataclass
class PackPlan:
    """The packed part of a conversion or append."""

    groups: list[PackGroup]
    seconds: float  # items no longer than this are packed
    batches: list[PackBatch] = field(default_factory=list)
    own: list[SourceItem] = field(default_factory=list)  # items keeping their own group

    @property
    def items(self) -> int:
        return sum(len(b) for b in self.batches)

    def placement(self, names: list[str], arrays: list[str]) -> Placement:
        """Where the items ``names`` lie (all of them new in this plan)."""
        out = Placement.unpacked(len(names), arrays)
        position = {name: i for i, name in enumerate(names)}
        for batch in self.batches:
            for item, offsets in zip(batch.items, batch.offsets):
                i = position[item.name]
                out.group[i], out.batch[i] = batch.group, batch.number
                for a, offset in offsets.items():
                    out.offsets[a][i] = offset
        return out


def timed(item: SourceItem, arrays: dict[str, ArrayInfo]) -> list[str]:
    """The names of ``item``'s time arrays (the others are stored whole)."""
    return [
        n
        for n, shape in item.shapes.items()
        if arrays[n].rate is not None and arrays[n].time_axis is not None and shape
    ]


def packable(item: SourceItem, arrays: dict[str, ArrayInfo], codec: str, seconds: float) -> bool:
    """Whether ``item`` is packed: it has a time array, every time array is no longer
    than ``seconds`` and of a form the converter encodes itself, and every array stored
    whole (a scalar label, an embedding) holds at most :data:`PACKED_WHOLE_BYTES` of
    numbers (kept in the batch's record)."""
    time = timed(item, arrays)
    if not time or seconds <= 0:
        return False
    for name, shape in item.shapes.items():
        dtype = np.dtype(item.dtypes[name])
        if name not in time:
            if dtype.kind not in "biufc" or math.prod(shape) * dtype.itemsize > PACKED_WHOLE_BYTES:
                return False
            continue
        info = arrays[name]
        assert info.rate is not None and info.time_axis is not None
        if not handles(codec, dtype, shape):
            return False
        if shape[info.time_axis % len(shape)] > math.floor(seconds * info.rate + 1e-9):
            return False
    return True


def plan_packs(
    items: list[SourceItem],
    arrays: dict[str, ArrayInfo],
    codec: str,
    chunk_seconds: float,
    seconds: float,
    existing: tuple[PackGroup, ...] = (),
) -> PackPlan:
    """Which of ``items`` are packed, and where (after the shards of ``existing``
    groups: an append starts each array on a fresh shard)."""
    axes = {n: a.time_axis for n, a in arrays.items() if a.time_axis is not None}
    groups = list(existing)
    index = {g.key(axes): k for k, g in enumerate(groups)}
    out = PackPlan(groups, float(seconds))
    open_batch: dict[int, PackBatch] = {}
    used: dict[int, dict[str, int]] = {}
    geos: dict[int, dict[str, tuple[int, int, int]]] = {}  # a group's geometry: its own
    for item in items:
        if not packable(item, arrays, codec, seconds):
            out.own.append(item)
            continue
        time = timed(item, arrays)  # the pack group's arrays; the others in the record
        key = signature({n: item.shapes[n] for n in time}, item.dtypes, axes)
        g = index.get(key)
        if g is None:
            g = index[key] = len(groups)
            shapes = {}
            for name in time:
                s = list(item.shapes[name])
                s[axes[name] % len(s)] = 0
                shapes[name] = tuple(s)
            path = f"{PACKED_ROOT}/{g}"
            dtypes = {n: np.dtype(item.dtypes[n]).str for n in time}
            groups.append(PackGroup(path, dtypes, shapes, 0))
        group = groups[g]
        if g not in geos:
            geos[g] = _geometry(group, arrays, chunk_seconds)
        geo = geos[g]
        batch = open_batch.get(g)
        lengths = {n: item.shapes[n][axes[n] % len(item.shapes[n])] for n in time}
        if batch is not None and not _fits(batch, used[g], lengths, geo):
            groups[g] = group = _closed(group, batch, used[g], geo, axes)
            batch = None
        if batch is None:
            starts = {n: group.shapes[n][axes[n] % len(group.shapes[n])] // geo[n][1] for n in geo}
            batch = open_batch[g] = PackBatch(g, group.batches, [], starts, {}, [])
            used[g] = {n: 0 for n in geo}
            out.batches.append(batch)
        offsets = {}
        for n, length in lengths.items():
            offsets[n] = batch.starts[n] * geo[n][1] + used[g][n]
            used[g][n] += length
        batch.items.append(item)
        batch.offsets.append(offsets)
    for g, batch in open_batch.items():
        groups[g] = _closed(groups[g], batch, used[g], geos[g], axes)
    return out


def _geometry(
    group: PackGroup, arrays: dict[str, ArrayInfo], chunk_seconds: float
) -> dict[str, tuple[int, int, int]]:
    """Per array of ``group``: (chunk, shard, bytes of one shard); the same for every
    length of the group's arrays."""
    out = {}
    for name, shape in group.shapes.items():
        info = arrays[name]
        assert info.rate is not None and info.time_axis is not None
        itemsize = np.dtype(group.dtypes[name]).itemsize
        chunks, shards = packed_geometry(shape, info.rate, info.time_axis, chunk_seconds, itemsize)
        axis = info.time_axis % len(shape)
        out[name] = (chunks[axis], shards[axis], shards[axis] * step_nbytes(shape, axis, itemsize))
    return out


def _fits(
    batch: PackBatch,
    used: dict[str, int],
    lengths: dict[str, int],
    geo: dict[str, tuple[int, int, int]],
) -> bool:
    if len(batch.items) >= BATCH_ITEMS:
        return False
    most = max(1, min(BATCH_SHARDS, BATCH_BYTES // max(1, max(g[2] for g in geo.values()))))
    return all(used[n] + lengths[n] <= most * geo[n][1] for n in lengths)


def _closed(
    group: PackGroup,
    batch: PackBatch,
    used: dict[str, int],
    geo: dict[str, tuple[int, int, int]],
    axes: dict[str, int],
) -> PackGroup:
    """``group`` grown by ``batch``'s whole shards (and the batch told how many)."""
    shapes = {}
    for name, shape in group.shapes.items():
        batch.shards[name] = shards_for(used[name], geo[name][1])
        s = list(shape)
        s[axes[name] % len(s)] = (batch.starts[name] + batch.shards[name]) * geo[name][1]
        shapes[name] = tuple(s)
    return dataclasses.replace(group, shapes=shapes, batches=group.batches + 1)


def group_objects(
    plan: PackPlan, arrays: dict[str, ArrayInfo], codec: str, chunk_seconds: float
) -> dict[str, bytes]:
    """The ``zarr.json`` documents of the pack groups the plan writes into (their
    shapes as the plan leaves them; shards already written are not touched)."""
    touched = sorted({b.group for b in plan.batches})
    out: dict[str, bytes] = {}
    if touched:
        out[f"{PACKED_ROOT}/zarr.json"] = group_meta({})
    for g in touched:
        group = plan.groups[g]
        out[f"{group.path}/zarr.json"] = group_meta({})
        for name in group.shapes:
            meta = packed_meta(group, name, arrays[name], codec, chunk_seconds)
            out[f"{group.array_path(name)}/zarr.json"] = dumps(meta)
    return out


def _record(batch: PackBatch, job: Job) -> dict[str, Any]:
    return {
        "items": [it.name for it in batch.items],
        "marks": sorted({str(job.mark(it.source)) for it in batch.items}),
    }


def encode_batch(
    job: Job, batch: PackBatch, verify: bool = False
) -> tuple[dict[str, bytes], dict[str, Any], Tally]:
    """The shard objects and the record of ``batch`` (keys relative to the store), and
    what was written.  ``verify``: the values the store should hold, nothing tallied."""
    group = job.packs[batch.group]
    arrays = {n: job.arrays[n] for n in group.shapes}
    geo = _geometry(group, job.arrays, job.chunk_seconds)
    buffers: dict[str, np.ndarray] = {}
    for name, shape in group.shapes.items():
        axis = arrays[name].time_axis % len(shape)  # type: ignore[operator]
        s = list(shape)
        s[axis] = batch.shards[name] * geo[name][1]
        buffers[name] = np.zeros(s, dtype=np.dtype(group.dtypes[name]))
    tally = Tally()
    entries: dict[str, Any] = {}
    at = {it.name: offsets for it, offsets in zip(batch.items, batch.offsets)}
    source_bytes = dict.fromkeys(buffers, 0)
    whole: dict[str, list[tuple[int, np.ndarray]]] = {}  # arrays kept in the record
    slot = {it.name: k for k, it in enumerate(batch.items)}  # read in file order
    for item, raws, attrs in read_items(batch.items):
        if not verify:  # read_items cast the values already (--dtype)
            tally.digests[item.name] = item_digest(raws)
        for name, raw in raws.items():
            if name not in buffers:
                if verify:
                    value = stored_values(job.arrays[name], raw)
                else:
                    value = prepared(job.arrays[name], raw, tally.array(name), item.name)
                    tally.array(name).stored_bytes += value.nbytes
                whole.setdefault(name, []).append((slot[item.name], value))
                continue
            axis = arrays[name].time_axis % raw.ndim  # type: ignore[operator]
            lo = at[item.name][name] - batch.starts[name] * geo[name][1]
            index: list[Any] = [slice(None)] * raw.ndim
            index[axis] = slice(lo, lo + raw.shape[axis])
            buffers[name][tuple(index)] = raw
            cast = item.cast_from.get(name)  # read cast: the file's bytes are its dtype's
            source_bytes[name] += raw.nbytes if cast is None else raw.size * cast.itemsize
            if not verify:
                tally.array(name).count_nonfinite(item.name, raw)
        if attrs:
            entries[item.name] = attrs
        tally.items += 1
    objects: dict[str, bytes] = {}
    for name, raw in buffers.items():
        # The values' census and rounding, once over the batch: the zeros between its
        # items are neither values nor noise (a per-item census cost ~12% of a batch).
        if verify:
            data = stored_values(arrays[name], raw)
        else:
            counts = tally.array(name)
            data = prepared(arrays[name], raw, counts)
            counts.source_bytes += source_bytes[name] - raw.nbytes  # the items' bytes only
        if not data.size:
            continue
        axis = arrays[name].time_axis % data.ndim  # type: ignore[operator]
        chunks, shards = list(data.shape), list(data.shape)
        chunks[axis], shards[axis] = geo[name][0], geo[name][1]
        for key, blob in encode_array(data, tuple(chunks), tuple(shards), job.codec, axis).items():
            coords = key.split("/")[1:]
            coords[axis] = str(int(coords[axis]) + batch.starts[name])
            objects[f"{group.array_path(name)}/c/{'/'.join(coords)}"] = blob
            tally.stored_bytes += len(blob)
            tally.array(name).stored_bytes += len(blob)
    names = sorted(group.shapes)
    record = {
        **_record(batch, job),
        # each item's span of every array: readable without zstore (see the README)
        "offsets": {n: [offsets[n] for offsets in batch.offsets] for n in names},
        "lengths": {
            n: [it.shapes[n][arrays[n].time_axis % len(it.shapes[n])] for it in batch.items]  # type: ignore[operator]
            for n in names
        },
        "entries": entries,
    }
    if not verify:  # each item's checksum (zstore.convert._copies), for a resumed run
        record["digests"] = [tally.digests[it.name] for it in batch.items]
    if whole:
        record["arrays"] = {name: record_array(values) for name, values in sorted(whole.items())}
    return objects, record, tally


def write_batch(job: Job, batch: PackBatch) -> list[Tally]:
    """Write ``batch``'s shards, then its record (the mark that it is complete)."""
    objects, record, tally = encode_batch(job, batch)
    writer = ObjectWriter(job.dst, job.storage_options)
    writer.put(objects, atomic=False)  # the record, written last, vouches for them
    blob = dumps(record)
    writer.put({job.packs[batch.group].record_key(batch.number): blob})
    tally.stored_bytes += len(blob)
    return [tally]


def verify_batch(job: Job, batch: PackBatch) -> list[str]:
    """Problems found comparing ``batch`` with the source, object by object (the
    encoding is deterministic)."""
    objects, record, _ = encode_batch(job, batch, verify=True)
    group = job.packs[batch.group]
    writer = ObjectWriter(job.dst, job.storage_options)
    where = f"{group.path} batch {batch.number} (items {batch.items[0].name} ...)"
    key = group.record_key(batch.number)
    got = writer.read_many([key, *objects])
    if key not in got:
        return [f"{where}: its record {key} is missing"]
    missing = [k for k in objects if k not in got]
    if missing:
        return [f"{where}: cannot be read back (object {missing[0]} is missing)"]
    try:
        kept = json.loads(got[key]).get("arrays", {})
    except ValueError as e:
        return [f"{where}: its record {key} cannot be read back ({e})"]
    wrong = sorted(
        n
        for n in {*kept, *record.get("arrays", {})}
        if kept.get(n) != record.get("arrays", {}).get(n)
    )
    if wrong:
        return [f"{where}: its record's '{wrong[0]}' (stored whole) differs from the source"]
    differ = [k for k, v in objects.items() if got[k] != v]
    if not differ:
        return []
    # Other bytes may still hold the same values (another compression level or Blosc
    # build) or values within the stated rounding: read them back.
    try:
        return _compare_spans(job, batch)
    except SourceError:
        raise
    except Exception as e:  # a checksum or codec failure is a finding
        return [
            f"{where}: object {differ[0]} differs from the source and cannot be read back ({e})"
        ]


def _compare_spans(job: Job, batch: PackBatch) -> list[str]:
    """Each item of ``batch`` read back through zarr against its source: bit-identical,
    or within the stated rounding (values stored more precisely than stated pass)."""
    import zarr

    from zstore.urls import zarr_store

    group = job.packs[batch.group]
    root = zarr.open_group(
        zarr_store(job.dst, job.storage_options, read_only=True), mode="r", use_consolidated=False
    )
    problems: list[str] = []
    at = {it.name: offsets for it, offsets in zip(batch.items, batch.offsets)}
    for item, raws, _ in read_items(batch.items):
        for name, source in raws.items():
            axis = job.arrays[name].time_axis % source.ndim  # type: ignore[operator]
            index: list[Any] = [slice(None)] * source.ndim
            index[axis] = slice(at[item.name][name], at[item.name][name] + source.shape[axis])
            array: Any = root[group.array_path(name)]
            got = np.asarray(array[tuple(index)])
            expected = stored_values(job.arrays[name], source)
            problems += compare_values(job, f"{item.name}/{name}", name, got, source, expected)
    return problems


def finished_batches(job: Job, batches: list[PackBatch]) -> dict[tuple[int, int], list[str]]:
    """(group, number) of the batches whose record names this job's items and marks,
    with their items' checksums (:data:`UNKNOWN` where the record has none)."""
    writer = ObjectWriter(job.dst, job.storage_options)
    keys = {job.packs[b.group].record_key(b.number): b for b in batches}
    found = writer.read_many(list(keys))
    done: dict[tuple[int, int], list[str]] = {}
    for key, raw in found.items():
        batch = keys[key]
        try:
            record = json.loads(raw)
        except ValueError:
            continue  # cut short: not complete
        want = _record(batch, job)
        if record.get("items") == want["items"] and record.get("marks") == want["marks"]:
            said = record.get("digests")
            if not isinstance(said, list) or len(said) != len(batch.items):
                said = [None] * len(batch.items)  # written before the checksums
            done[(batch.group, batch.number)] = [checked_digest(d) for d in said]
    return done


def write_packed(
    job: Job,
    plan: PackPlan,
    workers: int,
    progress: bool,
    desc: str,
    client: Any = None,
    fresh: bool = False,
    pool: Any = None,
) -> tuple[list[SourceItem], Tally, bool]:
    """Write the plan's batches not complete in the store yet (none are when it is
    ``fresh``), after the pack groups' metadata: the items written, what they were, and
    whether every batch was written now."""
    tally = Tally()
    if not plan.batches:
        return [], tally, True
    writer = ObjectWriter(job.dst, job.storage_options)
    metas = group_objects(plan, job.arrays, job.codec, job.chunk_seconds)
    writer.put(metas)
    tally.stored_bytes += sum(len(v) for v in metas.values())
    done = {} if fresh else finished_batches(job, plan.batches)
    todo = [b for b in plan.batches if (b.group, b.number) not in done]
    for b in plan.batches:  # the checksums of the batches written before
        for it, digest in zip(b.items, done.get((b.group, b.number), [])):
            tally.digests[it.name] = digest
    bar = Progress(plan.items, f"{desc} (packed)", progress)
    bar.update(plan.items - sum(len(b) for b in todo), 0)
    try:
        written = run_batches(write_batch, job, [], workers, bar, client, pool, tasks=todo)
    finally:
        bar.close()
    for t in written:
        tally.add(t)
    return [it for b in todo for it in b.items], tally, not done


def write_all(
    job: Job,
    own: SourcePlan,
    plan: PackPlan,
    workers: int,
    progress: bool,
    desc: str,
    client: Any = None,
    fresh: bool = False,
    pool: Any = None,
) -> tuple[list[SourceItem], Tally, bool]:
    """Write what the store lacks: the items of ``own`` (each in its own group), then
    the plan's batches; the items written, what they were, and whether everything was
    written now (else some was written before, and the caller measures the store)."""
    todo, tally, all_own = write_missing(job, own, workers, progress, desc, client, fresh, pool)
    packed, packed_tally, all_packed = write_packed(
        job, plan, workers, progress, desc, client, fresh, pool
    )
    return todo + packed, tally.add(packed_tally), all_own and all_packed


def verify_store(
    job: Job,
    own: SourcePlan,
    plan: PackPlan,
    workers: int,
    progress: bool,
    client: Any = None,
    pool: Any = None,
) -> None:
    """Compare every item, own and packed, with the source; raise naming what differs."""
    found: list[str] = []
    if plan.batches:
        bar = Progress(plan.items, "verify (packed)", progress)
        try:
            found = run_batches(
                verify_batch, job, [], workers, bar, client, pool, tasks=plan.batches
            )
        finally:
            bar.close()
    verify_all(job, own, workers, progress, client, pool, found)
