"""``zstore convert NEW.h5 DST --append``: add items to a finished store.

The store keeps its codec, chunking, rates, time axes and store id, so every chunk of
its existing items stays valid in every cache.  New items are named the way the store
names its items (``<file stem>/<group>`` when it was made from several files).  A name
that exists already is refused, naming it, before anything is written.  The new
manifest is published last: a new item table, then the root metadata in one write (no
consolidated metadata).  A reader opened before keeps its view, a new one sees the new
items.  Appending to a format-1 store writes a format-2 manifest.  Rerun the same
command after a crash to finish it.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zstore.convert._checks import check_options
from zstore.convert._copies import DIGESTS, appended, copies_text
from zstore.convert._corpus import (
    check_versions,
    expand_sources,
    file_identity,
    identity_mark,
    source_name,
    stems,
)
from zstore.convert._items import Job
from zstore.convert._new_arrays import planned_axes, planned_rates, with_new_arrays
from zstore.convert._packing import PackPlan, plan_packs, verify_store, write_all
from zstore.convert._report import ConvertReport, text_counts
from zstore.convert._skipped import extend
from zstore.convert._source import SourcePlan, check_unchanged, item_name, plan
from zstore.convert._space import destination_space
from zstore.convert._storelock import remove_stale_partials, store_lock
from zstore.convert._tasks import cluster_client
from zstore.convert._values import value_lines, warn_nonfinite, with_tally
from zstore.convert._virtual import READ_BY, changed_reads, reads_of
from zstore.convert.pipeline import plain, with_dtypes
from zstore.errors import SourceError, StoreFormatError, some_names
from zstore.format import (
    APPENDS,
    ArrayMetas,
    Manifest,
    Placement,
    build,
    current_shapes,
    data_type,
    parse_precision,
    publish,
    read_manifest,
    recorded,
    shape_rows,
)
from zstore.urls import is_url, store_bytes


def append(
    src: Any,
    dst: str | os.PathLike[str],
    *,
    workers: int | None = None,
    storage_options: dict[str, Any] | None = None,
    verify: bool = False,
    progress: bool = True,
    dask: Any = None,
    rates: Mapping[str, float | None] | None = None,
    time_axis: int | Mapping[str, int] | None = None,
    codec: str | None = None,
    chunk_seconds: float | None = None,
    precision: Mapping[str, int | str] | None = None,
    pack_seconds: float | None = None,
    dataset_items: str | None = None,
    dtypes: Mapping[str, str] | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    subgroups: str | None = None,
) -> ConvertReport:
    """Add the items of ``src`` (files, directories, globs) to the store at ``dst``;
    ``dask`` (a client or scheduler address) runs the items on a Dask cluster.

    The store keeps its codec, chunking, rates, time axes and stated precisions (new
    items are rounded as the store's were): ``rates``, ``time_axis``, ``codec``,
    ``chunk_seconds``, ``precision``, ``pack_seconds``, ``dataset_items``,
    ``subgroups`` and ``dtypes`` may be given only to state what the store has
    (anything else is refused before anything is written), and so are new items whose
    arrays have another dtype or number of dimensions than the store's.  Arrays the
    store lacks are added (the items before lack them): ``rates``, ``time_axis``,
    ``precision`` and ``dtypes`` entries for them plan them as a conversion would
    (:mod:`zstore.convert._new_arrays`).  A source appended before,
    unchanged, adds nothing (a rerun is safe); one changed since is refused.  One
    conversion or append at a time writes a store (see :mod:`zstore.convert._storelock`).
    ``include``/``exclude`` choose the new items as for :func:`zstore.convert.convert`.
    A file in the store, unchanged, given with patterns adds the items they choose that
    the store lacks (``include=["dev/*"]`` after a conversion of ``"train/*"``); given
    without, it adds nothing.
    """
    t0 = time.perf_counter()
    files, dst = expand_sources(src), os.fspath(dst)
    rates, precision = plain(rates), plain(precision)
    axes = time_axis if time_axis is None or isinstance(time_axis, int) else dict(time_axis)
    check_options(1.0 if chunk_seconds is None else chunk_seconds, workers)
    with destination_space(dst), store_lock(dst, storage_options):
        try:
            manifest, metas = read_manifest(dst, storage_options, history=True)
        except StoreFormatError as e:
            raise StoreFormatError(
                f"{dst}: no finished zstore store to append to; convert "
                f"the first files without --append ({e})"
            ) from None
        _check_options_agree(
            dst,
            manifest,
            rates,
            axes,
            codec,
            chunk_seconds,
            precision,
            pack_seconds=pack_seconds,
            dtypes=dtypes,
            dataset_items=dataset_items,
            subgroups=subgroups,
        )
        identities = {f: file_identity(f) for f in files}
        seen = _already_in_store(files, identities, manifest, dst)
        # a file in the store, unchanged, given with patterns: the items they choose
        # that the store lacks are new (``--include 'dev/*'`` after ``'train/*'``)
        again = seen if include or exclude else []
        files = [f for f in files if f not in seen or f in again]
        wanted = NewArrays(rates, axes, precision, dtypes)
        source = _plan_new(files, manifest, dst, wanted, include, exclude, again) if files else None
        if source is not None and again:
            given = {it.source for it in source.items}
            files = [f for f in files if f not in again or f in given]
            seen = [f for f in seen if f not in given]
        if source is None or not source.items:
            return ConvertReport(
                items=len(manifest.items),
                converted=0,
                already_done=len(manifest.items),
                source_bytes=0,
                store_bytes=int(manifest.extra.get("store_bytes", 0)),
                seconds=time.perf_counter() - t0,
                arrays=manifest.arrays,
                store_id=manifest.store_id,
                already_in_store=seen,
            )
        for f in files:  # the files its virtual datasets read: part of its version
            reads = reads_of(source.items, f)
            if reads:
                identities[f] = {**identities[f], "reads": reads}
        marks = tuple((f, identity_mark(identities[f])) for f in files)
        packs = plan_packs(
            source.items,
            source.arrays,  # the store's, and any it lacks that the new items bring
            manifest.codec,
            manifest.chunk_seconds,
            float(manifest.extra.get("pack_seconds", 0.0)),  # stores made before packing: 0
            manifest.packs,
        )
        job = Job(
            files[0],
            dst,
            storage_options,
            source.arrays,
            manifest.chunk_seconds,
            manifest.codec,
            marks,
            tuple(packs.groups),
        )
        own = dataclasses.replace(source, items=packs.own)
        workers = max(1, min(workers or os.cpu_count() or 1, max(1, len(source.items))))
        # what a killed run of this append left where it writes (this process holds the lock)
        groups = {packs.groups[b.group].path for b in packs.batches}
        remove_stale_partials(dst, [it.name for it in own.items] + sorted(groups))
        with cluster_client(dask) as client:
            todo, tally, all_now = write_all(job, own, packs, workers, progress, "append", client)
            if verify:
                verify_store(job, own, packs, workers, progress, client)
        before = int(manifest.extra.get("store_bytes", -1))
        nbytes = (
            before + tally.stored_bytes
            if all_now and before >= 0
            else store_bytes(dst, storage_options)
        )
        source.arrays = with_tally(source.arrays, tally)
        digests, found = appended(
            manifest.extra, list(manifest.items), [it.name for it in source.items], tally.digests
        )
        new, table = _extended(
            manifest,
            metas,
            source,
            [identities[f] for f in files],
            nbytes,
            packs,
            wanted.casts(manifest),
            digests,
        )
        check_unchanged(source.items, "append it again")
        check_versions([identities[f] for f in files], "append it again")
        publish(dst, storage_options, new.header(), table)
    warn_nonfinite(job.src, tally, stacklevel=2)
    if found:
        warnings.warn(f"{job.src}: {copies_text(found)}", stacklevel=2)
    total = sum(it.nbytes for it in source.items)
    return ConvertReport(
        items=len(new.items),
        converted=len(todo),
        already_done=len(new.items) - len(todo),
        source_bytes=total,
        store_bytes=int(new.extra.get("store_bytes", 0)),
        added_bytes=nbytes - before if before >= 0 else None,
        seconds=time.perf_counter() - t0,
        arrays=new.arrays,
        skipped=source.skipped,
        verified=verify,
        store_id=new.store_id,
        sources=files,
        already_in_store=seen,
        values=value_lines(new.arrays, tally, source.items, new.chunk_seconds, new.codec),
        packed=packs.items,
        copies=found,
        texts=text_counts(source.items),
    )


def _check_options_agree(
    dst: str,
    manifest: Manifest,
    rates: dict[str, float | None] | None,
    time_axis: int | dict[str, int] | None,
    codec: str | None,
    chunk_seconds: float | None,
    precision: dict[str, int | str] | None = None,
    *,
    pack_seconds: float | None = None,
    dtypes: Mapping[str, str] | None = None,
    dataset_items: str | None = None,
    subgroups: str | None = None,
) -> None:
    """Options given with an append must be the store's own (its precision and casts
    too: new items are rounded and cast as its items were)."""

    def refuse(given: str, has: str) -> None:
        raise SourceError(
            f"{dst}: {given} was given, but the store has {has}; an append "
            "keeps the store's options: leave it out, or convert these files "
            "to a new store"
        )

    if codec is not None and codec != manifest.codec:
        refuse(f"--codec {codec}", f"codec {manifest.codec}")
    packs = float(manifest.extra.get("pack_seconds", 0.0))
    if pack_seconds is not None and float(pack_seconds) != packs:
        refuse(f"--pack-seconds {pack_seconds:g}", f"items packed of at most {packs:g} s")
    cast = manifest.extra.get("dtypes", {})
    for_store = {n: str(d) for n, d in (dtypes or {}).items() if n in manifest.arrays}
    if any(cast.get(n) != d for n, d in for_store.items()):  # others: new arrays' casts
        refuse(
            f"--dtype {for_store}",
            f"casts of {cast or 'no array'} (new items are cast as its items were)",
        )
    made = manifest.extra.get("dataset_items")
    if dataset_items is not None and dataset_items != made:
        refuse(
            f"--dataset-items {dataset_items}",
            f"items that are datasets holding '{made}'"
            if made
            else "items that are groups (converted without --dataset-items)",
        )
    nested = manifest.extra.get("subgroups", "items")
    if subgroups is not None and subgroups != nested:
        refuse(f"--subgroups {subgroups}", f"groups inside items converted as {nested}")
    if chunk_seconds is not None and float(chunk_seconds) != float(manifest.chunk_seconds):
        refuse(f"--chunk-seconds {chunk_seconds:g}", f"{manifest.chunk_seconds:g} s chunks")
    for name, rate in (rates or {}).items():
        info = manifest.arrays.get(name)
        if info is None:
            continue  # a new array's (zstore.convert._new_arrays)
        has = (
            f"'{name}' stored whole (no rate)"
            if info.rate is None
            else f"'{name}' at {info.rate:g}/s"
        )
        same = (
            info.rate is None
            if rate is None
            else info.rate is not None and float(rate) == float(info.rate)
        )
        if not same:
            refuse(f"--rate {name}={'none' if rate is None else f'{rate:g}'}", has)
    for name, value in (precision or {}).items():
        given, info = parse_precision(name, value), manifest.arrays.get(name)
        if info is None:
            continue  # a new array's (zstore.convert._new_arrays)
        stated = info.precision
        if stated is None or stated.bits != given.bits:
            refuse(
                f"--precision {name}={value}",
                f"'{name}' stored lossless"
                if stated is None
                else f"'{name}' kept to {stated.bits} mantissa bits ({stated.stated})",
            )
    if time_axis is None:
        return
    for name, info in manifest.arrays.items():
        if isinstance(time_axis, dict) and name not in time_axis:
            continue
        axis = time_axis[name] if isinstance(time_axis, dict) else time_axis
        ndim = (
            manifest.shapes[name].shape[1]
            if manifest.shapes is not None and name in manifest.shapes
            else 0
        )
        if info.time_axis is not None and ndim and axis % ndim != info.time_axis:
            refuse(
                f"--time-axis {name}={axis}", f"axis {info.time_axis} as the time axis of '{name}'"
            )


def _already_in_store(
    files: list[str], identities: dict[str, dict[str, Any]], manifest: Manifest, dst: str
) -> list[str]:
    """The files the store holds already, unchanged; a file it holds that has changed
    since is refused (its items would be added twice, under other names)."""
    recorded: dict[str, dict[str, Any]] = {}
    for entry in [
        *manifest.extra.get("fingerprint", {}).get("sources", []),
        *manifest.extra.get("appended", []),
    ]:
        if isinstance(entry, dict) and "source" in entry and not entry.get(READ_BY):
            recorded[str(entry["source"])] = entry
    names = set(map(str, manifest.extra.get("sources", [])))
    by_size: dict[Any, list[str]] = {}  # local files the store records, by their size
    for source, entry in recorded.items():
        if not is_url(source):
            by_size.setdefault(entry.get("size"), []).append(source)
    seen = []
    for f in files:
        name = source_name(f)
        if name not in names and name not in recorded:
            linked = _linked_from(f, by_size.get(identities[f].get("size"), []))
            if linked is None:
                continue
            name = linked
            warnings.warn(
                f"{f}: the same file as {name} (a link to it), which {dst} holds already; "
                "its items are not added again",
                stacklevel=3,
            )
        was = recorded.get(name)
        what = _changed_since(was, identities[f]) if was is not None else None
        if what is not None:
            raise SourceError(
                f"{f}: this file's items were added to {dst} before, and {what}; nothing "
                "was written. To replace those items, convert the store again "
                "(--overwrite); to add the file as new items, give it another name"
            )
        seen.append(f)
    return seen


def _changed_since(was: dict[str, Any], now: dict[str, Any]) -> str | None:
    """How a file the store recorded as ``was`` has changed, ``now`` its version (before
    its scan): the file itself, or a file its virtual datasets or external storage read
    (recorded as ``reads``); None where neither has."""
    if any(now.get(k) != v for k, v in was.items() if k in now and k != "source"):
        return "the file has changed since (size or version)"
    read = changed_reads(was)
    return f"{read}, which its datasets read, has changed since" if read is not None else None


def _linked_from(f: str, candidates: list[str]) -> str | None:
    """The name under which the store recorded the local file ``f``, reached now under
    another name (a symbolic or hard link); None if it has none.  ``candidates``: the
    local files the store records with ``f``'s size, the only ones looked at on disk."""
    if is_url(f):
        return None
    for name in candidates:
        try:
            if os.path.samefile(name, f):
                return name
        except OSError:  # moved or deleted since it was converted
            continue
    return None


@dataclasses.dataclass(frozen=True)
class NewArrays:
    """What an append's options say of arrays (the store's own only stated; those the
    store lacks planned by them: :mod:`zstore.convert._new_arrays`)."""

    rates: Mapping[str, float | None] | None = None
    time_axis: int | Mapping[str, int] | None = None
    precision: Mapping[str, int | str] | None = None
    dtypes: Mapping[str, str] | None = None

    def names(self) -> set[str]:
        axes = self.time_axis if isinstance(self.time_axis, Mapping) else {}
        given = (self.rates, axes, self.precision, self.dtypes)
        return {n for option in given for n in option or {}}

    def casts(self, manifest: Manifest) -> dict[str, str]:
        """The store's casts, and those given for arrays it lacks: new items are cast as
        the store's were, and the manifest keeps both for the appends after."""
        new = {n: str(d) for n, d in (self.dtypes or {}).items() if n not in manifest.arrays}
        return {**manifest.extra.get("dtypes", {}), **new}


def _plan_new(
    files: list[str],
    manifest: Manifest,
    dst: str,
    given: NewArrays,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    again: Sequence[str] = (),
) -> SourcePlan:
    """The new items, named as the store names its items, checked against it.  Of the
    files ``again`` (in the store, unchanged), the items the store has are left out."""
    # Named as the conversion named the store's items: by <file stem>/<group> when it
    # was made from several files.  The files appended since do not count: else the
    # second append named its items unlike the first (and concurrent appends, by which
    # one published first).
    made_from = len(manifest.extra.get("sources", [])) - len(manifest.extra.get("appended", []))
    rates = planned_rates(manifest, given.rates)  # the store's claims, whole too
    axes, other_axes = planned_axes(manifest, given.time_axis)
    dataset_items = manifest.extra.get("dataset_items")  # as the conversion read its files
    casts = given.casts(manifest)  # new items are cast as the store's were
    subgroups = manifest.extra.get("subgroups", "items")  # as the conversion read them
    source = plan(
        files,
        rates,
        axes,
        optional=True,
        dataset_items=dataset_items,
        casts=casts,
        include=list(include or []),
        exclude=list(exclude or []),
        subgroups=subgroups,
        other_axes=other_axes,
    )
    prefix = stems(files) if made_from > 1 else None
    for it in source.items:
        it.name = item_name(it.group, it.source, prefix[it.source] if prefix else None)
    arrays = with_new_arrays(manifest, source, dst, given.names(), given.precision)
    _check_same_form(source, manifest, dst)
    for name, info in source.arrays.items():
        if name in manifest.arrays and info.rate != manifest.arrays[name].rate:
            raise SourceError(
                f"{dst}: '{name}' is at {manifest.arrays[name].rate}/s in the "
                f"store, {info.rate}/s in the new items; they must agree"
            )
    names = [it.name for it in source.items]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SourceError(
            f"{dst}: the new files name item(s) {twice[:3]} more than once "
            "(the store names items by group only); append them one by one "
            "or rename the groups"
        )
    existing = set(manifest.items)
    if again:
        source.items = [
            it for it in source.items if not (it.source in again and it.name in existing)
        ]
    clash = [it.name for it in source.items if it.name in existing]
    if clash:
        raise SourceError(
            f"{dst}: item(s) {some_names(clash, at_most=3)} are "
            "in the store already; nothing was written. Rename the groups, or "
            "append other files"
        )
    source.arrays = arrays
    return source


def _check_same_form(source: SourcePlan, manifest: Manifest, dst: str) -> None:
    """Every new item's arrays have the store's dtype and number of dimensions: the
    store's metadata and readers decode every item of an array as one dtype."""
    for it in source.items:
        for name, dtype in it.dtypes.items():
            info = manifest.arrays.get(name)
            if info is None:
                continue  # a new array: the scan checked it agrees across the new items
            if info.dtype is not None and data_type(np.dtype(dtype)) != info.dtype:
                raise SourceError(
                    f"{it.source}: '{it.group}/{name}' is {np.dtype(dtype)}, but '{name}' "
                    f"is {info.dtype} in {dst}; nothing was written. Convert the file to "
                    f"{info.dtype} first, or convert it to a store of its own"
                )
            if manifest.shapes is not None and name in manifest.shapes:
                ndim = manifest.shapes[name].shape[1]
                if len(it.shapes[name]) != ndim:
                    raise SourceError(
                        f"{it.source}: '{it.group}/{name}' has shape {it.shapes[name]} "
                        f"({len(it.shapes[name])} dimensions), but '{name}' has {ndim} in "
                        f"{dst}; nothing was written. Reshape it to the store's form, or "
                        "convert it to a store of its own"
                    )


def _extended(
    manifest: Manifest,
    metas: ArrayMetas,
    source: SourcePlan,
    identities: list[dict[str, Any]],
    nbytes: int,
    packs: PackPlan,
    casts: dict[str, str],
    digests: str,
) -> tuple[Manifest, dict[str, bytes]]:
    """The store's manifest with the new items after the old ones (same store id);
    ``casts`` the store's, with those of the arrays it gains; ``digests`` the checksums
    of all its items (zstore.convert._copies)."""
    old_shapes, old_present = current_shapes(manifest, metas)
    new_shapes, new_present = shape_rows(
        [it.shapes for it in source.items],
        source.arrays,
        {n: rows.shape[1] for n, rows in old_shapes.items()},
    )
    n_old, n_new = len(manifest.items), len(source.items)
    for name in source.arrays:
        if name not in manifest.arrays:  # new: the items before lack it
            old_shapes[name] = np.full((n_old, new_shapes[name].shape[1]), -1, dtype=np.int64)
            old_present[name] = np.zeros(n_old, dtype=bool)
    shapes = {n: np.concatenate([old_shapes[n], new_shapes[n]]) for n in source.arrays}
    present = {
        n: np.concatenate(
            [
                old_present.get(n, np.ones(n_old, dtype=bool)),
                new_present.get(n, np.ones(n_new, dtype=bool)),
            ]
        )
        for n in set(old_present) | set(new_present)
    }
    arrays = dict(source.arrays)
    for name, info in with_dtypes(source).items():
        if arrays[name].dtype is None and info.dtype is not None:
            arrays[name] = dataclasses.replace(arrays[name], dtype=info.dtype)
        arrays[name] = dataclasses.replace(
            arrays[name], precision=info.precision, values=info.values
        )
    extra = dict(manifest.extra)
    extra["sources"] = list(extra.get("sources", [])) + [i["source"] for i in identities]
    extra["appended"] = list(extra.get("appended", [])) + identities
    # this append's id and where its objects begin: the node caches key them apart from
    # what another copy of the store gained at the same paths (zstore.format.lineage)
    extra[APPENDS] = recorded(
        extra,
        uuid.uuid4().hex[:16],  # 64 bits: copies of one store never share one
        n_old,
        [(packs.groups[b.group].path, b.number, b.starts) for b in packs.batches],
    )
    if source.skipped:
        extra["skipped"] = extend(list(extra.get("skipped", [])), list(source.skipped))
    extra["store_bytes"] = nbytes
    extra[DIGESTS] = digests
    if casts:  # absent otherwise: stores without casts keep their header
        extra["dtypes"] = casts
    names = list(manifest.items) + [it.name for it in source.items]
    packed_arrays = sorted({n for g in packs.groups for n in g.shapes})
    before = manifest.placement or Placement.unpacked(n_old, packed_arrays)
    placement = Placement.joined(
        before, packs.placement([it.name for it in source.items], packed_arrays)
    )
    return build(
        packs=tuple(packs.groups),
        placement=placement,
        store_id=manifest.store_id,
        arrays=arrays,
        names=names,
        shapes=shapes,
        present=present,
        codec=manifest.codec,
        chunk_seconds=manifest.chunk_seconds,
        extra=extra,
    )
