"""HDF5 groups -> compressed, time-chunked, sharded Zarr v3 store.  Parallel, resumable, verified."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import json
import math
import os
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from zstore.convert.corpus import expand_sources
from zstore.convert.corpus import fingerprint as corpus_fingerprint
from zstore.convert.source import SourceItem, SourcePlan, open_source, plan
from zstore.convert.storelock import LOCK_NAME, store_lock, wipe
from zstore.convert.tasks import Progress, cluster_client, local_pool, run_batches
from zstore.errors import DestinationError, SourceError, StoreFormatError
from zstore.format.attrs import hdf5_attrs
from zstore.format.layout import (
    DONE_ATTR,
    MANIFEST_ATTR,
    PROGRESS_ATTR,
    ArrayInfo,
    Manifest,
    geometry,
)
from zstore.format.manifest import build, publish, shape_rows
from zstore.format.objects import (
    ObjectWriter,
    array_meta,
    data_type,
    dumps,
    encode_array,
    group_meta,
    handles,
)
from zstore.units import format_size
from zstore.urls import store_bytes, zarr_store

CODECS = ("lz4", "zstd", "none")
#: What a store's objects look like; part of a conversion's fingerprint, so a store that
#: an older zstore began is not resumed with another layout.  2: every chunk is written;
#: 3: chunks of small arrays hold at least MIN_CHUNK_BYTES.
LAYOUT = 3
#: chunk_seconds bounds: below 10 ms the per-chunk overhead (index entry, crc32c, codec
#: header: ~36 bytes) outweighs small arrays' data; above an hour a window reads far
#: more than it needs.
MIN_CHUNK_SECONDS, MAX_CHUNK_SECONDS = 0.01, 3600.0


def check_options(chunk_seconds: Any, workers: Any) -> None:
    """Refuse numbers the converter cannot use, before the destination is touched."""
    if (
        isinstance(chunk_seconds, bool)
        or not isinstance(chunk_seconds, (int, float))
        or not math.isfinite(chunk_seconds)
        or not MIN_CHUNK_SECONDS <= chunk_seconds <= MAX_CHUNK_SECONDS
    ):
        raise SourceError(
            f"--chunk-seconds {chunk_seconds!r}: must be a number from {MIN_CHUNK_SECONDS:g} "
            f"to {MAX_CHUNK_SECONDS:g} (shorter chunks cost more in per-chunk overhead than "
            "they hold; longer ones make windows read far more than they need); 1.0 suits "
            "windows of a few seconds"
        )
    if workers is not None and (
        isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
    ):
        raise SourceError(
            f"--workers {workers!r}: must be a whole number of processes, at "
            "least 1 (leave it out for one per CPU)"
        )


def check_chunks(source: SourcePlan, chunk_seconds: float) -> None:
    """Each time array's chunk must hold at least one sample at its rate."""
    for name, info in source.arrays.items():
        if info.rate is not None and info.rate * chunk_seconds < 1:
            raise SourceError(
                f"--rate {name}={info.rate:g} with --chunk-seconds {chunk_seconds:g}: a chunk "
                "would hold less than one sample (rates are samples per second, e.g. "
                f"--rate {name}=16000); give the real rate or longer chunks"
            )


def check_destination(dst: str, storage_options: dict[str, Any] | None) -> None:
    """A local destination must be a directory (or not exist yet) that can be written."""
    from zstore.urls import is_url, local_path

    if is_url(dst):
        return
    path = os.path.abspath(local_path(dst))
    if os.path.exists(path) and not os.path.isdir(path):
        raise DestinationError(
            f"{dst} is a file, not a directory; choose a directory "
            "for the store (it is created if missing)"
        )
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise DestinationError(
            f"{dst} lies under {probe}, which is a file; choose a destination in a directory"
        )
    if (
        not os.access(probe, os.W_OK | os.X_OK)
        or probe == "/proc"
        or probe.startswith("/proc/")
        or probe.startswith("/sys/")
    ):
        raise DestinationError(
            f"{dst}: cannot write in {probe} (no permission, or not a "
            "place for files); choose a writable directory"
        )


def compressors(codec: str) -> list[Any]:
    """Blosc lz4 + bitshuffle (ratio ~1.96, ~3 GB/s decode on the synthetic speech) by default."""
    if codec == "lz4":
        return [BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle"), Crc32cCodec()]
    if codec == "zstd":
        return [BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle"), Crc32cCodec()]
    if codec == "none":
        return [Crc32cCodec()]
    if codec == "zstd-plain":
        return [ZstdCodec(level=3), Crc32cCodec()]
    raise SourceError(f"codec {codec!r} is not known; pick one of {', '.join(CODECS)}")


@dataclass
class ConvertReport:
    """What :func:`convert` did."""

    items: int
    converted: int
    already_done: int
    source_bytes: int
    store_bytes: int
    seconds: float
    arrays: dict[str, ArrayInfo]
    skipped: list[str] = field(default_factory=list)
    verified: bool = False
    store_id: str = ""
    sources: list[str] = field(default_factory=list)
    #: sources left out of an append: in the store already, unchanged
    already_in_store: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.store_bytes / self.source_bytes if self.source_bytes else 0.0

    def __str__(self) -> str:
        lines = [
            f"sources: {len(self.sources)} file(s)"
            + (
                f" ({', '.join(self.sources[:3])}{', ...' if len(self.sources) > 3 else ''})"
                if self.sources
                else ""
            ),
            f"items: {self.items} ({self.converted} converted, {self.already_done} already done)",
            f"source: {format_size(self.source_bytes)}, store: "
            f"{format_size(self.store_bytes)} ({self.ratio:.2f}x), {self.seconds:.1f} s",
        ]
        for name, a in self.arrays.items():
            if a.rate:
                how = f"time array at {a.rate:g}/s" + (
                    f" (inferred): {a.note}"
                    if a.inferred and a.note
                    else " (inferred)"
                    if a.inferred
                    else ""
                )
            else:
                how = a.note or "stored whole (no time axis)"
            lines.append(f"  {name}: {how}")
        lines += [f"  skipped {s}" for s in self.skipped]
        lines += [
            f"already in the store, nothing added from it: {s}" for s in self.already_in_store
        ]
        if self.verified:
            lines.append("verified: every array equals the source")
        return "\n".join(lines)


@dataclass(frozen=True)
class _Job:
    src: str
    dst: str
    storage_options: dict[str, Any] | None
    arrays: dict[str, ArrayInfo]
    chunk_seconds: float
    codec: str
    #: per source file, the completion mark its items carry (an append's items name their
    #: file's version, so a rerun after the file changed writes them anew); else True
    marks: tuple[tuple[str, str], ...] = ()

    def mark(self, source: str) -> str | bool:
        return dict(self.marks).get(source, True)


def _geometry(
    shape: tuple[int, ...], info: ArrayInfo, chunk_seconds: float, itemsize: int
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    return geometry(shape, info.rate, info.time_axis, chunk_seconds, itemsize)


def _read(src_group: Any, item: SourceItem, name: str, ds: Any = None) -> np.ndarray:
    try:
        return (src_group[name] if ds is None else ds)[()]
    except (OSError, RuntimeError) as e:
        raise SourceError(
            f"{item.source}: reading '{item.group}/{name}' failed ({e}); the "
            "file may be truncated or corrupt: re-copy it"
        ) from None


def _write_items(job: _Job, items: list[SourceItem]) -> list[int]:
    """Write a batch of items (one task); each is marked complete only after all its
    arrays are written.  Arrays of the converter's usual form are encoded here
    (:mod:`zstore.format.objects`); others go through zarr's API.  Each item's stored bytes."""
    writer = ObjectWriter(job.dst, job.storage_options)
    root: Any = None
    out = []
    for item, src_group in _groups(items):
        objects: dict[str, bytes] = {}
        by_zarr = []
        for name in item.shapes:
            ds = src_group[name]
            shape, dtype = tuple(ds.shape), ds.dtype
            chunks, shards = _geometry(shape, job.arrays[name], job.chunk_seconds, dtype.itemsize)
            if not handles(job.codec, dtype, shape):
                by_zarr.append(name)
                continue
            data = _read(src_group, item, name, ds)
            axis = job.arrays[name].time_axis
            prefix = f"{item.name}/{name}/"
            objects[prefix + "zarr.json"] = dumps(
                array_meta(
                    shape, dtype, chunks, shards, job.codec, hdf5_attrs(ds), job.arrays[name].dims
                )
            )
            for key, blob in encode_array(
                data, chunks, shards, job.codec, -1 if axis is None else axis
            ).items():
                objects[prefix + key] = blob
        _parents(writer, item.name)
        writer.put(objects, atomic=False)  # the completion mark, written last, vouches
        if by_zarr:
            if root is None:
                root = zarr.open_group(
                    zarr_store(job.dst, job.storage_options, read_only=False), mode="r+"
                )
            _write_by_zarr(job, root, src_group, item, by_zarr)
        mark = group_meta({**hdf5_attrs(src_group), DONE_ATTR: job.mark(item.source)})
        writer.put({f"{item.name}/zarr.json": mark})
        out.append(
            store_bytes(f"{job.dst.rstrip('/')}/{item.name}", job.storage_options)
            if by_zarr
            else len(mark) + sum(len(v) for v in objects.values())
        )
    return out


def _groups(items: list[SourceItem]) -> Iterator[tuple[SourceItem, Any]]:
    """Each item with its HDF5 group, every source file opened once."""
    by_file: dict[str, list[SourceItem]] = {}
    for it in items:
        by_file.setdefault(it.source, []).append(it)
    for source_file, batch in by_file.items():
        with open_source(source_file) as f:
            for item in batch:
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
    job: _Job, root: zarr.Group, src_group: Any, item: SourceItem, names: list[str]
) -> None:
    group = root.require_group(item.name)
    for name in names:
        ds = src_group[name]
        data = _read(src_group, item, name)
        chunks, shards = _geometry(
            tuple(ds.shape), job.arrays[name], job.chunk_seconds, ds.dtype.itemsize
        )
        arr = group.create_array(
            name,
            shape=ds.shape,
            dtype=ds.dtype,
            chunks=chunks,
            shards=shards,
            compressors=compressors(job.codec),
            fill_value=0,
            overwrite=True,
            attributes=hdf5_attrs(ds),
            config={"write_empty_chunks": True},
            dimension_names=job.arrays[name].dims,
        )
        if data.size:
            arr[...] = data


def _verify_items(job: _Job, items: list[SourceItem]) -> list[str]:
    """Problems found comparing a batch of items with the source.  Arrays of the
    converter's usual form are compared object by object with the source encoded again
    (the encoding is deterministic and equals zarr's); others are read back by zarr."""
    writer = ObjectWriter(job.dst, job.storage_options)
    root: Any = None
    problems = []
    for item, src_group in _groups(items):
        for name in item.shapes:
            expected = _read(src_group, item, name)
            where = f"{item.name}/{name}"
            if handles(job.codec, expected.dtype, expected.shape):
                problems += _compare_objects(job, writer, where, name, expected)
                continue
            if root is None:
                root = zarr.open_group(
                    zarr_store(job.dst, job.storage_options, read_only=True),
                    mode="r",
                    use_consolidated=False,
                )
            try:
                got = root[where][...]
            except Exception as e:  # a checksum or codec failure is a finding
                problems.append(f"{where}: cannot be read back ({e})")
                continue
            if got.shape != expected.shape or got.tobytes() != expected.tobytes():
                problems.append(f"{where}: values differ from the source")
    return problems


def _compare_objects(
    job: _Job, writer: ObjectWriter, where: str, name: str, data: np.ndarray
) -> list[str]:
    info = job.arrays[name]
    chunks, shards = _geometry(data.shape, info, job.chunk_seconds, data.dtype.itemsize)
    want = encode_array(
        data, chunks, shards, job.codec, -1 if info.time_axis is None else info.time_axis
    )
    got = writer.read_many([f"{where}/{k}" for k in want])
    meta = writer.read_many([f"{where}/zarr.json"])
    if not meta:
        return [f"{where}: cannot be read back (its zarr.json is missing)"]
    missing = [k for k in want if f"{where}/{k}" not in got]
    if missing:
        return [f"{where}: cannot be read back (object {missing[0]} is missing)"]
    if any(got[f"{where}/{k}"] != v for k, v in want.items()):
        return [f"{where}: values differ from the source (a stored object differs)"]
    return []


def _prepare_destination(
    dst: str, storage_options: dict[str, Any] | None, fingerprint: dict[str, Any], overwrite: bool
) -> tuple[zarr.Group | None, bool]:
    """Open or create the root (None when the store is already finished), and whether
    it was created just now."""
    store = zarr_store(dst, storage_options, read_only=False)
    try:
        root: zarr.Group | None = zarr.open_group(store, mode="r+")
        attrs: dict[str, Any] = dict(root.attrs) if root is not None else {}
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, KeyError):
        root, attrs = None, {}
    if root is not None and not overwrite:
        if attrs.get(MANIFEST_ATTR, {}).get("fingerprint") == fingerprint:
            return None, False
        if attrs.get(PROGRESS_ATTR) == fingerprint:
            return root, False
        what = (
            "a zstore store of another source or other options"
            if MANIFEST_ATTR in attrs or PROGRESS_ATTR in attrs
            else "a Zarr hierarchy"
        )
        raise DestinationError(f"{dst} already holds {what}; pass --overwrite to replace it")
    if root is None and not overwrite and _has_files(dst, storage_options):
        raise DestinationError(
            f"{dst} exists and is not empty; pass --overwrite to replace it "
            "or choose a new destination"
        )
    wipe(dst, storage_options)  # all but the lock this process holds
    root = zarr.open_group(store, mode="a")
    root.attrs.put({PROGRESS_ATTR: fingerprint})
    return root, True


def _has_files(dst: str, storage_options: dict[str, Any] | None) -> bool:
    import fsspec

    fs, path = fsspec.core.url_to_fs(dst, **(storage_options or {}))
    try:
        return any(c.rstrip("/").rsplit("/", 1)[-1] != LOCK_NAME for c in fs.ls(path))
    except (FileNotFoundError, NotADirectoryError):
        return fs.exists(path)


def convert(
    src: str | os.PathLike[str] | list[str | os.PathLike[str]],
    dst: str | os.PathLike[str],
    *,
    rates: dict[str, float | None] | None = None,
    time_axis: int | dict[str, int] = -1,
    chunk_seconds: float = 1.0,
    codec: str = "lz4",
    workers: int | None = None,
    storage_options: dict[str, Any] | None = None,
    verify: bool = False,
    progress: bool = True,
    overwrite: bool = False,
    dask: Any = None,
) -> ConvertReport:
    """Rechunk the HDF5 file ``src`` into a zstore (Zarr v3) store at ``dst``.

    Args:
        src: an HDF5 file, a directory (every ``*.h5``/``*.hdf5`` below it), a glob
            pattern, an fsspec URL, or a list of them; every group that holds datasets
            becomes an item (named ``<file stem>/<group>`` with several files).
        dst: local path or fsspec URL (``s3://bucket/x.zarr``).
        rates: samples per second per array name, e.g. ``{"wav": 16000, "act": 100}``;
            ``None`` stores that array whole (no time axis).  Other arrays get a rate
            only when their length has the same whole-number ratio to a rated array's
            in items of at least two lengths; the rest are stored whole (the report
            says which, and the ``--rate`` to give).
        time_axis: the time axis of the time arrays (default: last), or
            ``{"wav": 0}`` for arrays stored time-first (the others: last).
        chunk_seconds: chunk duration along time.
        codec: ``"lz4"`` (default), ``"zstd"`` or ``"none"``; crc32c is always added.
        workers: processes writing items in parallel (default: the CPU count).
        storage_options: passed to fsspec for ``dst``.
        verify: re-read every array and compare with the source.
        progress: show a progress bar.
        overwrite: replace whatever ``dst`` holds.
        dask: a ``distributed.Client`` or a scheduler address: run every item as a task
            on that Dask cluster instead of local processes (``workers`` is then
            unused). Sources and ``dst`` must be reachable from the workers.

    Rerunning after a crash resumes: finished items are kept, the rest are written.
    Rerunning on a finished store of the same source and options does nothing.
    """
    t0 = time.perf_counter()
    files, dst = expand_sources(src), os.fspath(dst)
    src = files[0] if len(files) == 1 else f"{len(files)} sources"
    compressors(codec)
    check_options(chunk_seconds, workers)
    options = {
        "rates": {k: None if v is None else float(v) for k, v in (rates or {}).items()},
        "time_axis": time_axis,
        "chunk_seconds": chunk_seconds,
        "codec": codec,
        "layout": LAYOUT,
    }
    wanted = workers or os.cpu_count() or 1
    with contextlib.ExitStack() as stack:
        pool = None if dask is not None else stack.enter_context(local_pool(wanted))
        source = plan(files, rates, time_axis)
        check_chunks(source, chunk_seconds)
        check_destination(dst, storage_options)
        fingerprint = corpus_fingerprint(files, options)
        client = stack.enter_context(cluster_client(dask))  # before the destination is touched
        job = _Job(src, dst, storage_options, source.arrays, chunk_seconds, codec)
        return _convert(
            job,
            source,
            files,
            fingerprint,
            workers=max(1, min(wanted, len(source.items))),
            overwrite=overwrite,
            verify=verify,
            progress=progress,
            client=client,
            pool=pool,
            t0=t0,
        )


def _convert(
    job: _Job,
    source: SourcePlan,
    files: list[str],
    fingerprint: dict[str, Any],
    *,
    workers: int,
    overwrite: bool,
    verify: bool,
    progress: bool,
    client: Any,
    pool: cf.ProcessPoolExecutor | None,
    t0: float,
) -> ConvertReport:
    """:func:`convert` once the source is planned and the workers are up."""
    with store_lock(job.dst, job.storage_options):
        return _convert_locked(
            job,
            source,
            files,
            fingerprint,
            workers=workers,
            overwrite=overwrite,
            verify=verify,
            progress=progress,
            client=client,
            pool=pool,
            t0=t0,
        )


def _convert_locked(
    job: _Job,
    source: SourcePlan,
    files: list[str],
    fingerprint: dict[str, Any],
    *,
    workers: int,
    overwrite: bool,
    verify: bool,
    progress: bool,
    client: Any,
    pool: cf.ProcessPoolExecutor | None,
    t0: float,
) -> ConvertReport:
    """:func:`_convert` while this process holds the store's lock."""
    dst, storage_options = job.dst, job.storage_options
    try:
        root, fresh = _prepare_destination(dst, storage_options, fingerprint, overwrite)
    except OSError as e:
        if isinstance(e, DestinationError):
            raise
        raise DestinationError(
            f"{dst}: cannot create the store there ({e}); choose a writable destination"
        ) from None
    total_src = sum(it.nbytes for it in source.items)
    for s in source.skipped:
        warnings.warn(f"{job.src}: skipping {s}", stacklevel=3)
    if root is None:  # finished earlier from the same source and options
        if verify:
            _verify(job, source, workers, progress, client, pool)
        report = _report(source, dst, storage_options, t0, 0, total_src)
        report.verified, report.sources = verify, files
        return report
    todo, written = write_missing(
        job, source, workers, progress, "convert", client, fresh=fresh, pool=pool
    )
    nbytes = written if written is not None else store_bytes(dst, storage_options)
    manifest, table = _manifest(source, job.codec, job.chunk_seconds, fingerprint, nbytes)
    if verify:
        _verify(job, source, workers, progress, client, pool)
    publish(dst, storage_options, manifest.header(), table)
    report = _report(source, dst, storage_options, t0, len(todo), total_src, nbytes)
    report.verified, report.store_id = verify, manifest.store_id
    report.sources = files
    return report


def _verify(
    job: _Job,
    source: SourcePlan,
    workers: int,
    progress: bool,
    client: Any = None,
    pool: cf.ProcessPoolExecutor | None = None,
) -> None:
    bar = Progress(len(source.items), "verify", progress)
    try:
        problems = run_batches(_verify_items, job, source.items, workers, bar, client, pool)
    finally:
        bar.close()
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise StoreFormatError(
            f"{job.dst}: verification failed: {'; '.join(problems[:5])}"
            f"{more}; rerun with --overwrite to convert again"
        )


def write_missing(
    job: _Job,
    source: SourcePlan,
    workers: int,
    progress: bool,
    desc: str,
    client: Any = None,
    fresh: bool = False,
    pool: cf.ProcessPoolExecutor | None = None,
) -> tuple[list[SourceItem], int | None]:
    """Write the items of ``source`` not yet complete in the store (none are when it is
    ``fresh``): the ones written, and their stored bytes when every item of ``source``
    was written now (None when some were done before: the caller measures the store)."""
    done = set() if fresh else _finished_items(job, source.items)
    todo = [it for it in source.items if it.name not in done]
    bar = Progress(len(source.items), desc, progress)
    bar.update(len(source.items) - len(todo), 0)
    try:
        written = run_batches(_write_items, job, todo, workers, bar, client, pool)
    finally:
        bar.close()
    return todo, (sum(written) if not done else None)


def _finished_items(job: _Job, items: list[SourceItem]) -> set[str]:
    """The items whose group carries the completion mark (written after their arrays)
    that this job would write (an append's mark names its source file's version)."""
    writer = ObjectWriter(job.dst, job.storage_options)
    found = writer.read_many([f"{it.name}/zarr.json" for it in items])
    done = set()
    for it in items:
        raw = found.get(f"{it.name}/zarr.json")
        try:
            mark = json.loads(raw).get("attributes", {}).get(DONE_ATTR) if raw else None
        except ValueError:
            continue  # cut short by a crash: not complete
        if mark is not None and mark == job.mark(it.source):
            done.add(it.name)
    return done


def _manifest(
    source: SourcePlan, codec: str, chunk_seconds: float, fingerprint: dict[str, Any], nbytes: int
) -> tuple[Manifest, dict[str, bytes]]:
    shapes, present = shape_rows([it.shapes for it in source.items], source.arrays)
    return build(
        store_id=uuid.uuid4().hex,
        arrays=with_dtypes(source),
        names=[it.name for it in source.items],
        shapes=shapes,
        present=present,
        codec=codec,
        chunk_seconds=chunk_seconds,
        extra={
            "fingerprint": fingerprint,
            "store_bytes": nbytes,
            "sources": [s["source"] for s in fingerprint["sources"]],
            **({"skipped": list(source.skipped)} if source.skipped else {}),
        },
    )


def with_dtypes(source: SourcePlan) -> dict[str, ArrayInfo]:
    """The plan's arrays with their dtype (the same in every item that has them)."""
    dtypes: dict[str, str] = {}
    for it in source.items:
        for name, dt in it.dtypes.items():
            dtypes.setdefault(name, data_type(np.dtype(dt)))
    return {n: dataclasses.replace(a, dtype=dtypes.get(n)) for n, a in source.arrays.items()}


def _report(
    source: SourcePlan,
    dst: str,
    storage_options: dict[str, Any] | None,
    t0: float,
    converted: int,
    total_src: int,
    nbytes: int | None = None,
) -> ConvertReport:
    return ConvertReport(
        items=len(source.items),
        converted=converted,
        already_done=len(source.items) - converted,
        source_bytes=total_src,
        store_bytes=store_bytes(dst, storage_options) if nbytes is None else nbytes,
        seconds=time.perf_counter() - t0,
        arrays=source.arrays,
        skipped=source.skipped,
    )
