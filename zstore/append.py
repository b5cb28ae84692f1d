"""``zstore convert NEW.h5 DST --append``: add items to a finished store.

The store keeps its codec, chunking, rates, time axes and store id, so every chunk of
its existing items stays valid in every cache.  New items are named the way the store
names its items (``<file stem>/<group>`` when it was made from several files).  A name
that exists already is refused, naming it, before anything is written.  The new
manifest is published last, in one write of the root metadata: a reader opened before
keeps its view, a new one sees the new items.  Rerun the same command after a crash
to finish it.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import zarr

from zstore.convert import (ConvertReport, _Job, _verify, check_options, cluster_client,
                            write_missing)
from zstore.corpus import expand_sources, source_name, stems
from zstore.errors import SourceError, StoreFormatError
from zstore.layout import MANIFEST_ATTR, Manifest
from zstore.origin import store_bytes, zarr_store
from zstore.source import SourcePlan, plan


def append(src: Any, dst: str | os.PathLike[str], *, workers: int | None = None,
           storage_options: dict[str, Any] | None = None, verify: bool = False,
           progress: bool = True, dask: Any = None) -> ConvertReport:
    """Add the items of ``src`` (files, directories, globs) to the store at ``dst``;
    ``dask`` (a client or scheduler address) runs the items on a Dask cluster."""
    t0 = time.perf_counter()
    files, dst = expand_sources(src), os.fspath(dst)
    check_options(1.0, workers)
    try:
        root = zarr.open_group(zarr_store(dst, storage_options, read_only=False), mode="r+")
        manifest = Manifest.from_json(dict(root.attrs).get(MANIFEST_ATTR), dst)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, KeyError):
        raise StoreFormatError(f"{dst}: no finished zstore store to append to; convert the "
                               "first files without --append") from None
    source = _plan_new(files, manifest, dst)
    job = _Job(files[0], dst, storage_options, manifest.arrays, manifest.chunk_seconds,
               manifest.codec)
    workers = max(1, min(workers or os.cpu_count() or 1, max(1, len(source.items))))
    with cluster_client(dask) as client:
        todo = write_missing(job, source, root, workers, progress, "append", client)
        if verify:
            _verify(job, source, workers, progress, client)
    new = _extended(manifest, source, files, store_bytes(dst, storage_options))
    root.attrs.put({**dict(root.attrs), MANIFEST_ATTR: new.to_json()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=UserWarning)
        zarr.consolidate_metadata(zarr_store(dst, storage_options, read_only=False))
    total = sum(it.nbytes for it in source.items)
    return ConvertReport(items=len(new.items), converted=len(todo),
                         already_done=len(new.items) - len(todo), source_bytes=total,
                         store_bytes=int(new.extra.get("store_bytes", 0)),
                         seconds=time.perf_counter() - t0, arrays=new.arrays,
                         skipped=source.skipped, verified=verify,
                         store_id=new.store_id, sources=files)


def _plan_new(files: list[str], manifest: Manifest, dst: str) -> SourcePlan:
    """The new items, named as the store names its items, checked against it."""
    sources = manifest.extra.get("sources", [])
    rates = {n: a.rate for n, a in manifest.arrays.items() if a.rate and not a.inferred}
    axes = {n: a.time_axis for n, a in manifest.arrays.items() if a.time_axis is not None}
    source = plan(files, rates, axes)
    prefix = stems(files) if len(sources) > 1 else None  # as the store names its items
    for it in source.items:
        it.name = f"{prefix[it.source]}/{it.group}" if prefix else it.group
    unknown = sorted(n for n in source.arrays if n not in manifest.arrays)
    if unknown:
        raise SourceError(f"{dst}: the new items have array(s) {unknown} that the store does "
                          f"not (arrays: {sorted(manifest.arrays)}); convert them separately")
    for name, info in source.arrays.items():
        if info.rate != manifest.arrays[name].rate:
            raise SourceError(f"{dst}: '{name}' is at {manifest.arrays[name].rate}/s in the "
                              f"store, {info.rate}/s in the new items; they must agree")
    names = [it.name for it in source.items]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SourceError(f"{dst}: the new files name item(s) {twice[:3]} more than once "
                          "(the store names items by group only); append them one by one "
                          "or rename the groups")
    existing = set(manifest.items)
    clash = [it.name for it in source.items if it.name in existing]
    if clash:
        more = f" and {len(clash) - 3} more" if len(clash) > 3 else ""
        raise SourceError(f"{dst}: item(s) {', '.join(repr(c) for c in clash[:3])}{more} are "
                          "in the store already; nothing was written. Rename the groups, or "
                          "append other files")
    source.arrays = dict(manifest.arrays)
    return source


def _extended(manifest: Manifest, source: SourcePlan, files: list[str],
              nbytes: int) -> Manifest:
    """The store's manifest with the new items after the old ones (same store id)."""
    offset = len(manifest.items)
    lengths = {n: list(v) for n, v in manifest.lengths.items()}
    present = {n: list(v) for n, v in manifest.present.items()}
    for name in lengths:
        lengths[name] += [source.length(it, name) if name in it.shapes else -1
                          for it in source.items]
    for name in manifest.arrays:
        have = [offset + i for i, it in enumerate(source.items) if name in it.shapes]
        if name in present or len(have) < len(source.items):
            present[name] = present.get(name, list(range(offset))) + have
    extra = dict(manifest.extra)
    extra["sources"] = list(extra.get("sources", [])) + [source_name(f) for f in files]
    extra["store_bytes"] = nbytes
    return Manifest(store_id=manifest.store_id, arrays=manifest.arrays,
                    items=manifest.items + [it.name for it in source.items], lengths=lengths,
                    codec=manifest.codec, chunk_seconds=manifest.chunk_seconds,
                    all_chunks_written=manifest.all_chunks_written, present=present,
                    extra=extra)

