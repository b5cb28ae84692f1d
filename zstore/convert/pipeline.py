"""HDF5 groups -> compressed, time-chunked, sharded Zarr v3 store.  Parallel, resumable, verified."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import os
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from zstore.convert._checks import (
    check_chunks,
    check_dataset_items,
    check_options,
    check_pack_seconds,
)
from zstore.convert._copies import DIGESTS, UNKNOWN, copies, copies_text, pack_digests
from zstore.convert._corpus import check_versions, expand_sources
from zstore.convert._corpus import differences as corpus_differences
from zstore.convert._corpus import fingerprint as corpus_fingerprint
from zstore.convert._items import Job, compressors
from zstore.convert._packing import PackPlan, plan_packs, verify_store, write_all
from zstore.convert._report import ConvertReport, text_counts
from zstore.convert._skipped import MAX_WARNINGS
from zstore.convert._source import SourcePlan, check_unchanged, plan
from zstore.convert._space import destination_space
from zstore.convert._storelock import (
    LOCK_NAME,
    PARTIAL,
    remove_stale_partials,
    store_lock,
    wipe,
)
from zstore.convert._subgroups import check_subgroups
from zstore.convert._tasks import cluster_client, local_pool
from zstore.convert._values import value_lines, warn_nonfinite, with_precision, with_tally
from zstore.convert._virtual import READ_BY, read_by_datasets
from zstore.errors import DestinationError, StoreFormatError
from zstore.format import (
    MANIFEST_ATTR,
    PACK_SECONDS,
    PROGRESS_ATTR,
    ArrayInfo,
    Manifest,
    build,
    data_type,
    parse_precision,
    publish,
    same_conversion,
    shape_rows,
    with_history,
)
from zstore.origin import Origin
from zstore.urls import store_bytes, zarr_store

if TYPE_CHECKING:
    import zarr

#: What a store's objects look like; part of a conversion's fingerprint, so a store that
#: an older zstore began is not resumed with another layout.  2: every chunk is written;
#: 3: chunks of small arrays hold at least MIN_CHUNK_BYTES.
LAYOUT = 3
#: options of a conversion that its manifest keeps for appends (absent when not given)
APPEND_KEEPS = ("dataset_items", "dtypes", "subgroups")


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


def _prepare_destination(
    dst: str, storage_options: dict[str, Any] | None, fingerprint: dict[str, Any], overwrite: bool
) -> tuple[zarr.Group | None, bool]:
    """Open or create the root (None when the store is already finished), and whether
    it was created just now."""
    import zarr  # here: ~0.2 s to import, and the converter's workers import this module

    store = zarr_store(dst, storage_options, read_only=False)
    try:
        root: zarr.Group | None = zarr.open_group(store, mode="r+")
        attrs: dict[str, Any] = dict(root.attrs) if root is not None else {}
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, KeyError):
        root, attrs = None, {}
    if root is not None and not overwrite:
        header = attrs.get(MANIFEST_ATTR)
        if isinstance(header, dict) and same_conversion(header, fingerprint):
            return None, False
        if attrs.get(PROGRESS_ATTR) == fingerprint:
            return root, False
        if MANIFEST_ATTR in attrs or PROGRESS_ATTR in attrs:
            old = _converted_with(dst, storage_options, header) or attrs.get(PROGRESS_ATTR)
            raise DestinationError(
                f"{dst} already holds a zstore store "
                f"{'converted' if MANIFEST_ATTR in attrs else 'begun'} otherwise "
                f"({corpus_differences(old, fingerprint)}); pass --overwrite to replace it, or "
                "--append to add a new source's items to a finished store"
            )
        raise DestinationError(
            f"{dst} already holds a Zarr hierarchy; pass --overwrite to replace it"
        )
    if root is None and not overwrite and _has_files(dst, storage_options):
        raise DestinationError(
            f"{dst} exists and is not empty; pass --overwrite to replace it "
            "or choose a new destination"
        )
    wipe(dst, storage_options)  # all but the lock this process holds
    # made with its progress mark in one write: made bare and marked after, a converter
    # killed between the two left "a Zarr hierarchy" its rerun refused
    root = zarr.create_group(store, attributes={PROGRESS_ATTR: fingerprint})
    return root, True


def _converted_with(dst: str, storage_options: dict[str, Any] | None, header: Any) -> Any:
    """The fingerprint of the conversion that made the finished store at ``dst`` (root
    ``header``), from its history: the root's, or the item table's ``zarr.json`` alone,
    not the table (None where it cannot be read: the refusal then says less)."""
    if not isinstance(header, dict):
        return None
    try:
        full = with_history(header, Origin(dst, storage_options), dst, header.get("table"))
    except (StoreFormatError, OSError):
        return None
    return full.get("fingerprint")


def _has_files(dst: str, storage_options: dict[str, Any] | None) -> bool:
    """Whether ``dst`` holds anything but this converter's lock and what a killed
    converter's unfinished writes left (a converter killed while zarr wrote the store's
    first root leaves only zarr's temporary file: its rerun must convert, not refuse)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(dst, **(storage_options or {}))
    try:
        names = [c.rstrip("/").rsplit("/", 1)[-1] for c in fs.ls(path)]
    except (FileNotFoundError, NotADirectoryError):
        return bool(fs.exists(path))
    return any(n != LOCK_NAME and not PARTIAL.fullmatch(n) for n in names)


T = TypeVar("T")


def plain(option: Mapping[str, T] | None) -> dict[str, T] | None:
    """A mapping option (rates, time axes, precision) as the dict the planners take."""
    return None if option is None else dict(option)


def convert(
    src: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    dst: str | os.PathLike[str],
    *,
    rates: Mapping[str, float | None] | None = None,
    time_axis: int | Mapping[str, int] = -1,
    chunk_seconds: float = 1.0,
    codec: str = "lz4",
    workers: int | None = None,
    storage_options: dict[str, Any] | None = None,
    verify: bool = False,
    progress: bool = True,
    overwrite: bool = False,
    dask: Any = None,
    precision: Mapping[str, int | str] | None = None,
    pack_seconds: float = PACK_SECONDS,
    dataset_items: str | None = None,
    dtypes: Mapping[str, str] | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    subgroups: str = "items",
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
        precision: per float array, the precision to keep, e.g. ``{"wav": "100dB"}``
            (the fewest mantissa bits that guarantee that SNR) or ``{"wav": 16}``
            (mantissa bits): values are rounded to nearest before the usual codecs, so
            the store compresses true-float audio better and stays core Zarr.  Arrays
            not named (and integer arrays) keep their exact values.
        pack_seconds: items whose every array is a time array no longer than this are
            packed: stored back to back in shared arrays (``zstore_packed/<g>/<array>``,
            each item's offset in the item table), a few objects per hundred items
            instead of five per item.  0 gives every item its own group.
        dataset_items: for a file of one dataset per recording (``/utt0``,
            ``/audio/utt1``, ...) rather than one group: the name of the array each
            dataset becomes, e.g. ``"wav"``; every numeric dataset is then an item named
            by its path, its attributes the item's.
        dtypes: per float array, the float dtype the store keeps, e.g.
            ``{"wav": "float32"}`` for float64 audio, or for groups of float32 and
            float64 alike: values are cast (to nearest) before they are encoded.
        include, exclude: shell-style patterns (``"spk*/utt*"``, ``"meta"``) of the items
            to take, and of those to leave out, matched against each item's group path
            (and its name in the store); the report counts those left out.
        subgroups: what a group that holds datasets is when it lies inside another:
            ``"items"`` (default), an item of its own (the scan warns); ``"arrays"``,
            part of the outermost one, its datasets arrays of that item named by
            their path below it with ``.`` for ``/`` (``/utt0/feats/mfcc`` is array
            ``feats.mfcc`` of item ``utt0``).

    Rerunning after a crash resumes: finished items are kept, the rest are written.
    Rerunning on a finished store of the same source and options does nothing.
    """
    t0 = time.perf_counter()
    files, dst = expand_sources(src), os.fspath(dst)
    try:
        sources = corpus_fingerprint(files, {})["sources"]  # before any of them is read
    except OSError:  # a missing or unreadable file: the scan names it
        sources = None
    rates, precision = plain(rates), plain(precision)
    axes = time_axis if isinstance(time_axis, int) else dict(time_axis)
    src = files[0] if len(files) == 1 else f"{len(files)} sources"
    compressors(codec)
    check_options(chunk_seconds, workers)
    check_pack_seconds(pack_seconds)
    stated = {n: parse_precision(n, v) for n, v in (precision or {}).items()}
    options: dict[str, Any] = {
        "rates": {k: None if v is None else float(v) for k, v in (rates or {}).items()},
        "time_axis": axes,
        "chunk_seconds": chunk_seconds,
        "codec": codec,
        "layout": LAYOUT,
    }
    if stated:  # absent otherwise: stores made without it keep their fingerprint
        options["precision"] = {n: p.bits for n, p in sorted(stated.items())}
    if dataset_items is not None:  # absent otherwise, as precision
        check_dataset_items(dataset_items)
        options["dataset_items"] = dataset_items
    check_subgroups(subgroups, dataset_items)
    if subgroups != "items":  # absent otherwise, as precision
        options["subgroups"] = subgroups
    casts = {n: str(d) for n, d in sorted((dtypes or {}).items())}
    if casts:
        options["dtypes"] = casts
    chosen = {"include": list(include or []), "exclude": list(exclude or [])}
    for key, patterns in chosen.items():
        if patterns:  # absent otherwise, as precision
            options[key] = patterns
    wanted = workers or os.cpu_count() or 1
    with contextlib.ExitStack() as stack:
        pool = None if dask is not None else stack.enter_context(local_pool(wanted))
        source = plan(
            files,
            rates,
            axes,
            pool=pool,
            dataset_items=dataset_items,
            casts=casts,
            include=chosen["include"],
            exclude=chosen["exclude"],
            subgroups=subgroups,
        )
        source.arrays = with_precision(with_dtypes(source), dtypes_of(source), stated, src)
        check_chunks(source, chunk_seconds)
        check_destination(dst, storage_options)
        packs = plan_packs(source.items, source.arrays, codec, chunk_seconds, pack_seconds)
        if packs.batches:  # absent otherwise: stores without packed items keep theirs
            options["pack_seconds"] = float(pack_seconds)
        if sources is None:
            sources = corpus_fingerprint(files, {})["sources"]
        sources = sources + read_by_datasets(source.items, sources)
        fingerprint = {"sources": sources, "options": options}
        client = stack.enter_context(cluster_client(dask))  # before the destination is touched
        job = Job(
            src,
            dst,
            storage_options,
            source.arrays,
            chunk_seconds,
            codec,
            packs=tuple(packs.groups),
        )
        stack.enter_context(destination_space(str(dst)))  # a full disk: one clear error
        stack.enter_context(store_lock(dst, storage_options))  # one writer at a time
        return _convert(
            job,
            source,
            packs,
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
    job: Job,
    source: SourcePlan,
    packs: PackPlan,
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
    """:func:`convert` once the source is planned, the workers are up and this process
    holds the store's lock."""
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
    unasked = [s for s in source.skipped if s not in source.chosen]
    for s in unasked[:MAX_WARNINGS]:
        warnings.warn(f"{job.src}: skipping {s}", stacklevel=3)
    if len(unasked) > MAX_WARNINGS:
        warnings.warn(
            f"{job.src}: skipping {len(unasked) - MAX_WARNINGS} more kinds of "
            "things; the report lists them, and 'zstore info --json DST' once converted",
            stacklevel=3,
        )
    own = dataclasses.replace(source, items=packs.own)
    if root is None:  # finished earlier from the same source and options
        if verify:
            verify_store(job, own, packs, workers, progress, client, pool)
        report = _report(source, dst, storage_options, t0, 0, total_src)
        report.verified, report.sources, report.packed = verify, files, packs.items
        return report
    if not fresh:  # resumed: what a killed run's writes cut short left (it holds the lock)
        remove_stale_partials(dst)
    todo, tally, all_now = write_all(
        job, own, packs, workers, progress, "convert", client, fresh=fresh, pool=pool
    )
    nbytes = tally.stored_bytes if all_now else store_bytes(dst, storage_options)
    arrays = with_tally(with_dtypes(source), tally)
    digests = [tally.digests.get(it.name, UNKNOWN) for it in source.items]
    manifest, table = _manifest(source, arrays, job, fingerprint, nbytes, packs, digests)
    if verify:
        verify_store(job, own, packs, workers, progress, client, pool)
    check_unchanged(source.items, "convert it again with --overwrite")
    check_versions(fingerprint["sources"], "convert it again with --overwrite")
    publish(dst, storage_options, manifest.header(), table)
    report = _report(source, dst, storage_options, t0, len(todo), total_src, nbytes)
    report.packed = packs.items
    report.verified, report.store_id = verify, manifest.store_id
    report.sources, report.arrays = files, arrays
    report.values = value_lines(arrays, tally, source.items, job.chunk_seconds, job.codec)
    report.copies = copies([it.name for it in source.items], digests)
    warn_nonfinite(job.src, tally, stacklevel=3)
    if report.copies:
        warnings.warn(f"{job.src}: {copies_text(report.copies)}", stacklevel=3)
    return report


def _manifest(
    source: SourcePlan,
    arrays: dict[str, ArrayInfo],
    job: Job,
    fingerprint: dict[str, Any],
    nbytes: int,
    packs: PackPlan,
    digests: list[str],
) -> tuple[Manifest, dict[str, bytes]]:
    shapes, present = shape_rows([it.shapes for it in source.items], source.arrays)
    names = [it.name for it in source.items]
    packed_arrays = sorted({n for g in packs.groups for n in g.shapes})
    return build(
        packs=tuple(packs.groups),
        placement=packs.placement(names, packed_arrays),
        store_id=uuid.uuid4().hex,
        arrays=arrays,
        names=names,
        shapes=shapes,
        present=present,
        codec=job.codec,
        chunk_seconds=job.chunk_seconds,
        extra={
            # what an append must read its files as: kept from the conversion's options
            **{k: v for k, v in fingerprint["options"].items() if k in APPEND_KEEPS},
            "pack_seconds": packs.seconds,
            "fingerprint": fingerprint,
            "store_bytes": nbytes,
            "sources": [s["source"] for s in fingerprint["sources"] if not s.get(READ_BY)],
            **({"skipped": list(source.skipped)} if source.skipped else {}),
            DIGESTS: pack_digests(digests),
        },
    )


def dtypes_of(source: SourcePlan) -> dict[str, set[str]]:
    """Per array, the dtypes its items have."""
    out: dict[str, set[str]] = {}
    for it in source.items:
        for name, dt in it.dtypes.items():
            out.setdefault(name, set()).add(np.dtype(dt).str)
    return out


def with_dtypes(source: SourcePlan) -> dict[str, ArrayInfo]:
    """The plan's arrays with their dtype (the same in every item that has them)."""
    dtypes: dict[str, str] = {}
    for it in source.items:
        for name, dt in it.dtypes.items():
            if name not in dtypes:
                dtypes[name] = data_type(np.dtype(dt))
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
        texts=text_counts(source.items),
    )
