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
from typing import Any

import numpy as np

from zstore.convert import (ConvertReport, _Job, _verify, check_options, with_dtypes,
                            write_missing)
from zstore.corpus import expand_sources, source_name, stems
from zstore.errors import SourceError, StoreFormatError
from zstore.layout import Manifest
from zstore.manifests import ArrayMetas, build, current_shapes, publish, read_manifest, shape_rows
from zstore.origin import store_bytes
from zstore.source import SourcePlan, plan
from zstore.tasks import cluster_client


def append(src: Any, dst: str | os.PathLike[str], *, workers: int | None = None,
           storage_options: dict[str, Any] | None = None, verify: bool = False,
           progress: bool = True, dask: Any = None) -> ConvertReport:
    """Add the items of ``src`` (files, directories, globs) to the store at ``dst``;
    ``dask`` (a client or scheduler address) runs the items on a Dask cluster."""
    t0 = time.perf_counter()
    files, dst = expand_sources(src), os.fspath(dst)
    check_options(1.0, workers)
    try:
        manifest, metas = read_manifest(dst, storage_options)
    except StoreFormatError as e:
        raise StoreFormatError(f"{dst}: no finished zstore store to append to; convert the "
                               f"first files without --append ({e})") from None
    source = _plan_new(files, manifest, dst)
    job = _Job(files[0], dst, storage_options, manifest.arrays, manifest.chunk_seconds,
               manifest.codec)
    workers = max(1, min(workers or os.cpu_count() or 1, max(1, len(source.items))))
    with cluster_client(dask) as client:
        todo, written = write_missing(job, source, workers, progress, "append", client)
        if verify:
            _verify(job, source, workers, progress, client)
    before = int(manifest.extra.get("store_bytes", -1))
    nbytes = before + written if written is not None and before >= 0 else \
        store_bytes(dst, storage_options)
    new, table = _extended(manifest, metas, source, files, nbytes)
    publish(dst, storage_options, new.header(), table)
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
    source = plan(files, rates, axes, optional=True)
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


def _extended(manifest: Manifest, metas: ArrayMetas, source: SourcePlan, files: list[str],
              nbytes: int) -> tuple[Manifest, dict[str, bytes]]:
    """The store's manifest with the new items after the old ones (same store id)."""
    old_shapes, old_present = current_shapes(manifest, metas)
    new_shapes, new_present = shape_rows([it.shapes for it in source.items], manifest.arrays,
                                         {n: rows.shape[1] for n, rows in old_shapes.items()})
    n_old, n_new = len(manifest.items), len(source.items)
    shapes = {n: np.concatenate([old_shapes[n], new_shapes[n]]) for n in manifest.arrays}
    present = {n: np.concatenate([old_present.get(n, np.ones(n_old, dtype=bool)),
                                  new_present.get(n, np.ones(n_new, dtype=bool))])
               for n in set(old_present) | set(new_present)}
    arrays = dict(manifest.arrays)
    for name, info in with_dtypes(source).items():
        if arrays[name].dtype is None and info.dtype is not None:
            arrays[name] = dataclasses.replace(arrays[name], dtype=info.dtype)
    extra = dict(manifest.extra)
    extra["sources"] = list(extra.get("sources", [])) + [source_name(f) for f in files]
    extra["store_bytes"] = nbytes
    return build(store_id=manifest.store_id, arrays=arrays,
                 names=list(manifest.items) + [it.name for it in source.items],
                 shapes=shapes, present=present, codec=manifest.codec,
                 chunk_seconds=manifest.chunk_seconds, extra=extra)
