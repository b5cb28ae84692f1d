"""Writing and verifying items: each item's objects encoded (or written through zarr's
API where the converter does not encode them itself), marked complete only after all its
arrays are written, and compared with the source on ``--verify``.  Run in batches by
:mod:`zstore.convert._tasks`, for a conversion and for an append."""

from __future__ import annotations

import concurrent.futures as cf
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from zstore.convert._blocks import WHOLE, Block, blocks
from zstore.convert._casts import cast_values
from zstore.convert._copies import ArrayDigest, checked_digest, item_digest
from zstore.convert._fields import source_dataset
from zstore.convert._filters import read_failure
from zstore.convert._source import SourceItem, SourcePlan, open_source
from zstore.convert._tasks import Progress, in_flight, run_batches
from zstore.convert._values import Tally, prepared, stored_values
from zstore.errors import SourceError, StoreFormatError
from zstore.format import (
    DIGEST_ATTR,
    DONE_ATTR,
    PRECISION_ATTR,
    ArrayInfo,
    ObjectWriter,
    PackGroup,
    array_meta,
    dumps,
    effective_bits,
    encode_array,
    geometry,
    group_meta,
    handles,
    hdf5_attrs,
    text_attrs,
    within_rounding,
)
from zstore.urls import store_bytes, zarr_store

if TYPE_CHECKING:
    import zarr

CODECS = ("lz4", "zstd", "none")


def compressors(codec: str) -> list[Any]:
    """Blosc lz4 + bitshuffle (ratio ~1.96, ~3 GB/s decode on the synthetic speech) by default."""
    from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec  # zarr: ~0.2 s to import

    if codec == "lz4":
        return [BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle"), Crc32cCodec()]
    if codec == "zstd":
        return [BloscCodec(cname="zstd", clevel=2, shuffle="bitshuffle"), Crc32cCodec()]
    if codec == "none":
        return [Crc32cCodec()]
    if codec == "zstd-plain":
        return [ZstdCodec(level=3), Crc32cCodec()]
    raise SourceError(f"codec {codec!r} is not known; pick one of {', '.join(CODECS)}")


@dataclass(frozen=True)
class Job:
    src: str
    dst: str
    storage_options: dict[str, Any] | None
    arrays: dict[str, ArrayInfo]
    chunk_seconds: float
    codec: str
    #: per source file, the completion mark its items carry (an append's items name their
    #: file's version, so a rerun after the file changed writes them anew); else True
    marks: tuple[tuple[str, str], ...] = ()
    #: the pack groups packed items are written into (as the plan leaves them)
    packs: tuple[PackGroup, ...] = ()

    def mark(self, source: str) -> str | bool:
        return dict(self.marks).get(source, True)


def _geometry(
    shape: tuple[int, ...], info: ArrayInfo, chunk_seconds: float, itemsize: int
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    return geometry(shape, info.rate, info.time_axis, chunk_seconds, itemsize)


def read_array(
    src_group: Any, item: SourceItem, name: str, ds: Any = None, select: tuple[slice, ...] = ()
) -> np.ndarray:
    """Array ``name`` of ``item`` as the file holds it, or the block ``select`` of it (a
    cast is applied by :func:`zstore.convert._values.prepared`)."""
    try:
        return (source_dataset(src_group, item.fields, name) if ds is None else ds)[select]
    except (OSError, RuntimeError) as e:
        where = item.fields.get(name, (name, ""))[0]  # the dataset: a compound's, or itself
        path = f"{item.group}/{where}" if where else item.group
        raise read_failure(item.source, src_group.file, path, e) from None


def _attributes(job: Job, name: str, ds: Any) -> dict[str, Any]:
    """An array's attributes: the HDF5 dataset's, and its stated precision."""
    precision = job.arrays[name].precision
    attrs = hdf5_attrs(ds)
    if precision is not None and effective_bits(precision, ds.dtype) is not None:
        attrs[PRECISION_ATTR] = precision.attribute()
    return attrs


def _write_items(job: Job, items: list[SourceItem]) -> list[Tally]:
    """Write a batch of items (one task); each is marked complete only after all its
    arrays are written.  Arrays of the converter's usual form are encoded here
    (:mod:`zstore.format.objects`); others go through zarr's API.  Float arrays with a
    stated precision are rounded first.  What was written, as a list of one tally."""
    writer = ObjectWriter(job.dst, job.storage_options)
    root: Any = None
    tally = Tally()
    for item, src_group in source_groups(items):
        objects: dict[str, bytes] = {}
        written = streamed = 0  # object and source bytes of arrays written in blocks
        by_zarr = []
        values: dict[str, np.ndarray] = {}  # as stored, before any rounding: the checksum
        parts: dict[str, ArrayDigest] = {}  # the same, of arrays written in blocks
        _parents(writer, item.name)
        for name in item.shapes:
            ds = source_dataset(src_group, item.fields, name)
            info = job.arrays[name]
            shape, dtype = tuple(ds.shape), np.dtype(item.dtypes[name])  # cast, if any
            chunks, shards = _geometry(shape, info, job.chunk_seconds, dtype.itemsize)
            if not handles(job.codec, dtype, shape):
                by_zarr.append(name)
                continue
            counts = tally.array(name)
            prefix = f"{item.name}/{name}/"
            meta = dumps(
                array_meta(
                    shape, dtype, chunks, shards, job.codec, _attributes(job, name, ds), info.dims
                )
            )
            objects[prefix + "zarr.json"] = meta
            counts.stored_bytes += len(meta)
            axis = -1 if info.time_axis is None else info.time_axis
            for block in blocks(ds, shape, info, job.chunk_seconds, dtype.itemsize):
                raw = read_array(src_group, item, name, ds, block.select)
                cast = cast_values(info.dtype, raw, f"item '{item.name}'")
                data = prepared(info, raw, counts, item.name, cast)
                encoded = encode_array(data, chunks, shards, job.codec, axis, block.first)
                size = sum(len(blob) for blob in encoded.values())
                counts.stored_bytes += size
                if block is WHOLE:
                    values[name] = cast
                    objects.update((prefix + key, blob) for key, blob in encoded.items())
                    continue
                parts.setdefault(name, ArrayDigest(name, shape, axis)).add(cast, block.start)
                writer.put({prefix + key: blob for key, blob in encoded.items()}, atomic=False)
                written += size
                in_flight(raw.nbytes)  # the bar moves within a long item
                streamed += raw.nbytes
                del raw, cast, data, encoded  # before the next block is read
        writer.put(objects, atomic=False)  # the completion mark, written last, vouches
        if by_zarr:
            if root is None:
                import zarr  # only for arrays the converter does not encode itself

                root = zarr.open_group(
                    zarr_store(job.dst, job.storage_options, read_only=False), mode="r+"
                )
            _write_by_zarr(job, root, src_group, item, by_zarr, tally, values)
        digest = tally.digests[item.name] = item_digest(values, parts)
        attrs = hdf5_attrs(src_group)
        attrs.update(text_attrs(src_group.id, item.texts, attrs))
        mark = group_meta({**attrs, DONE_ATTR: job.mark(item.source), DIGEST_ATTR: digest})
        writer.put({f"{item.name}/zarr.json": mark})
        tally.items += 1
        if streamed:
            in_flight(-streamed)  # counted whole with the item's batch now
        tally.stored_bytes += (
            store_bytes(f"{job.dst.rstrip('/')}/{item.name}", job.storage_options)
            if by_zarr
            else len(mark) + written + sum(len(v) for v in objects.values())
        )
    return [tally]


def source_files(items: list[SourceItem]) -> Iterator[tuple[SourceItem, Any]]:
    """Each item with its open HDF5 file, every source file opened once."""
    by_file: dict[str, list[SourceItem]] = {}
    for it in items:
        by_file.setdefault(it.source, []).append(it)
    for source_file, batch in by_file.items():
        with open_source(source_file) as f:
            for item in batch:
                yield item, f


def source_groups(items: list[SourceItem]) -> Iterator[tuple[SourceItem, Any]]:
    """Each item with its HDF5 group, every source file opened once."""
    for item, f in source_files(items):
        yield item, f[item.group]


def _parents(writer: ObjectWriter, name: str) -> None:
    """Groups above a nested item (``spk/rec9``): Zarr v3 has no implicit groups."""
    parts = name.split("/")[:-1]
    for k in range(1, len(parts) + 1):
        key = "/".join(parts[:k]) + "/zarr.json"
        if key not in writer.written_groups and not writer.exists(key):
            writer.put({key: group_meta({})})
        writer.written_groups.add(key)


def _write_by_zarr(
    job: Job,
    root: zarr.Group,
    src_group: Any,
    item: SourceItem,
    names: list[str],
    tally: Tally,
    values: dict[str, np.ndarray],
) -> None:
    """Write arrays ``names`` of ``item`` through zarr's API (``values`` gets each as
    stored, before rounding)."""
    group = root.require_group(item.name)
    for name in names:
        ds = source_dataset(src_group, item.fields, name)
        raw = read_array(src_group, item, name)
        values[name] = cast_values(job.arrays[name].dtype, raw, f"item '{item.name}'")
        data = prepared(job.arrays[name], raw, tally.array(name), item.name, values[name])
        chunks, shards = _geometry(
            tuple(ds.shape), job.arrays[name], job.chunk_seconds, data.dtype.itemsize
        )
        arr = group.create_array(
            name,
            shape=ds.shape,
            dtype=data.dtype,
            chunks=chunks,
            shards=shards,
            compressors=compressors(job.codec),
            fill_value=0,
            overwrite=True,
            attributes=_attributes(job, name, ds),
            config={"write_empty_chunks": True},
            dimension_names=job.arrays[name].dims,
        )
        if data.size:
            arr[...] = data


def _verify_items(job: Job, items: list[SourceItem]) -> list[str]:
    """Problems found comparing a batch of items with the source.  Arrays of the
    converter's usual form are compared object by object with the source encoded again
    (the encoding is deterministic and equals zarr's); others, and any whose objects
    differ (a store written with another compression level or Blosc build holds other
    bytes for the same values), are read back by zarr and compared value by value."""
    writer = ObjectWriter(job.dst, job.storage_options)
    root: Any = None
    problems = []
    for item, src_group in source_groups(items):
        checked = 0  # source bytes of arrays compared in blocks, for the bar
        for name in item.shapes:
            ds = source_dataset(src_group, item.fields, name)
            shape, itemsize = tuple(ds.shape), np.dtype(item.dtypes[name]).itemsize
            where = f"{item.name}/{name}"
            for block in blocks(ds, shape, job.arrays[name], job.chunk_seconds, itemsize):
                source = read_array(src_group, item, name, ds, block.select)
                if block is not WHOLE:
                    in_flight(source.nbytes)
                    checked += source.nbytes
                expected = stored_values(job.arrays[name], source)
                if handles(job.codec, expected.dtype, expected.shape):
                    found = _compare_objects(job, writer, where, name, expected, shape, block)
                    if not found or "missing" in found[0]:
                        problems += found
                        continue
                if root is None:
                    import zarr  # only for arrays the converter does not encode itself

                    root = zarr.open_group(
                        zarr_store(job.dst, job.storage_options, read_only=True),
                        mode="r",
                        use_consolidated=False,
                    )
                try:
                    got = root[where][block.select or ...]
                except Exception as e:  # a checksum or codec failure is a finding
                    problems.append(f"{where}: cannot be read back ({e})")
                    continue
                problems += compare_values(job, where, name, got, source, expected)
        if checked:
            in_flight(-checked)
    return problems


def compare_values(
    job: Job, where: str, name: str, got: np.ndarray, source: np.ndarray, expected: np.ndarray
) -> list[str]:
    """A stored array read back against its source: bit-identical, or for an array with
    a stated precision, every value within that rounding of the source."""
    precision = job.arrays[name].precision
    bits = None if precision is None else effective_bits(precision, source.dtype)
    if bits is None or got.dtype != source.dtype:
        if got.shape != expected.shape or got.tobytes() != expected.tobytes():
            return [f"{where}: values differ from the source"]
        return []
    wrong = within_rounding(got, source, bits)
    if wrong:
        return [
            f"{where}: {wrong} value(s) differ from the source by more than rounding to "
            f"{bits} mantissa bits (--precision {name}={precision.stated if precision else ''})"
        ]
    return []


def _compare_objects(
    job: Job,
    writer: ObjectWriter,
    where: str,
    name: str,
    data: np.ndarray,
    shape: tuple[int, ...],
    block: Block,
) -> list[str]:
    """The stored objects of ``block`` of an array of ``shape`` against ``data`` (the
    block's values as stored) encoded again."""
    info = job.arrays[name]
    chunks, shards = _geometry(shape, info, job.chunk_seconds, data.dtype.itemsize)
    axis = -1 if info.time_axis is None else info.time_axis
    want = encode_array(data, chunks, shards, job.codec, axis, block.first)
    got = writer.read_many([f"{where}/{k}" for k in want])
    if block.start == 0 and not writer.read_many([f"{where}/zarr.json"]):  # once an array
        return [f"{where}: cannot be read back (its zarr.json is missing)"]
    missing = [k for k in want if f"{where}/{k}" not in got]
    if missing:
        return [f"{where}: cannot be read back (object {missing[0]} is missing)"]
    if any(got[f"{where}/{k}"] != v for k, v in want.items()):
        return [f"{where}: values differ from the source (a stored object differs)"]
    return []


def verify_all(
    job: Job,
    source: SourcePlan,
    workers: int,
    progress: bool,
    client: Any = None,
    pool: cf.ProcessPoolExecutor | None = None,
    found: list[str] | None = None,
) -> None:
    """Compare every item of ``source`` with the store; raise naming what differs (and
    the problems ``found`` already, by the packed items' check)."""
    problems = list(found or [])
    if source.items:
        bar = Progress(len(source.items), "verify", progress)
        try:
            problems += run_batches(_verify_items, job, source.items, workers, bar, client, pool)
        finally:
            bar.close()
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise StoreFormatError(
            f"{job.dst}: verification failed: {'; '.join(problems[:5])}"
            f"{more}; rerun with --overwrite to convert again"
        )


def write_missing(
    job: Job,
    source: SourcePlan,
    workers: int,
    progress: bool,
    desc: str,
    client: Any = None,
    fresh: bool = False,
    pool: cf.ProcessPoolExecutor | None = None,
) -> tuple[list[SourceItem], Tally, bool]:
    """Write the items of ``source`` not yet complete in the store (none are when it is
    ``fresh``): the ones written, what they were, and whether every item of ``source``
    was written now (else the caller measures the store's bytes)."""
    done = {} if fresh else _finished_items(job, source.items)
    todo = [it for it in source.items if it.name not in done]
    bar = Progress(len(source.items), desc, progress)
    bar.update(len(source.items) - len(todo), 0)
    try:
        written = run_batches(_write_items, job, todo, workers, bar, client, pool)
    finally:
        bar.close()
    total = Tally(digests=dict(done))  # the checksums of the items written before
    for t in written:
        total.add(t)
    return todo, total, not done


def _finished_items(job: Job, items: list[SourceItem]) -> dict[str, str]:
    """The items whose group carries the completion mark (written after their arrays)
    that this job would write (an append's mark names its source file's version), with
    their checksums (:data:`UNKNOWN` where the mark has none)."""
    writer = ObjectWriter(job.dst, job.storage_options)
    found = writer.read_many([f"{it.name}/zarr.json" for it in items])
    done: dict[str, str] = {}
    for it in items:
        raw = found.get(f"{it.name}/zarr.json")
        try:
            attrs = json.loads(raw).get("attributes", {}) if raw else {}
        except ValueError:
            continue  # cut short by a crash: not complete
        mark = attrs.get(DONE_ATTR)
        if mark is not None and mark == job.mark(it.source):
            done[it.name] = checked_digest(attrs.get(DIGEST_ATTR))
    return done
