"""Reading short items out of an HDF5 source for packing: their arrays and attributes,
with as little of HDF5's per-object machinery as the scan allows.

A short item is a few tens of KB, so what costs is per object, not per byte: HDF5's read
path (~100 us an item), opening a group to read its attributes (~25 us), mapping file
pages (a fault per page in a fresh worker).  Datasets the scan found stored contiguously
are read straight from the file at their offsets (one ``preadv`` each) while the file is
the one scanned; attributes are opened by path, as many as the scan counted.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import h5py
import numpy as np

from zstore.convert._casts import cast_values
from zstore.convert._fields import ITSELF, source_dataset
from zstore.convert._filters import read_failure
from zstore.convert._items import source_files
from zstore.convert._source import SourceItem, identity_of
from zstore.format import hdf5_attrs, hdf5_attrs_at, hdf5_attrs_of, text_attrs


def read_items(
    items: list[SourceItem],
) -> Iterator[tuple[SourceItem, dict[str, np.ndarray], dict[str, Any]]]:
    """Each item with its arrays and its attributes (``{"attrs": group's, "arrays":
    {name: dataset's}}``, only those it has), each source file opened once.  Through
    h5py's low-level API: a small item's read is mostly the high-level objects' cost."""
    with contextlib.ExitStack() as stack:
        fds: dict[str, int | None] = {}
        for item, f in source_files(items):
            if item.source not in fds:
                fds[item.source] = _direct(item, stack)
            yield item, *_read_item(f, item, fds[item.source])


def _direct(item: SourceItem, stack: contextlib.ExitStack) -> int | None:
    """A descriptor of the source file, to read datasets at their offsets, when the scan
    found such datasets and the file is the one it scanned (same size, modification
    time and inode)."""
    if item.identity is None or not item.offsets:
        return None
    try:
        fh = stack.enter_context(open(item.source, "rb", buffering=0))
        now = identity_of(fh.fileno())
    except OSError:
        return None  # HDF5 reads it, and names any failure
    return fh.fileno() if now == item.identity and now[0] else None


def _read_at(fd: int, out: np.ndarray, offset: int) -> None:
    """Fill ``out`` with the file's bytes at ``offset``."""
    view = memoryview(out).cast("B")  # type: ignore[arg-type]
    got = os.preadv(fd, [view], offset) if hasattr(os, "preadv") else _pread(fd, out, offset)
    if got != out.nbytes:
        raise OSError(f"{out.nbytes - got} bytes short of the scanned size")


def _pread(fd: int, out: np.ndarray, offset: int) -> int:
    data = os.pread(fd, out.nbytes, offset)
    out.reshape(-1).view(np.uint8)[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    return len(data)


def _read_item(
    f: Any, item: SourceItem, fd: int | None
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """An item's arrays: contiguous datasets read straight from the file, others by
    HDF5; and the attributes of the objects the scan counted attributes on."""
    where = item.group
    counts = item.with_attrs
    try:
        gid: Any = None
        arrays: dict[str, np.ndarray] = {}
        attrs: dict[str, Any] = {}
        for name, shape in item.shapes.items():
            if name in item.fields:  # a compound's field, a subgroup's dataset: on its own
                ds = source_dataset(f[item.group], item.fields, name)
                arrays[name] = ds[()]
                own = hdf5_attrs(ds)  # as an item of its own group keeps them
                if own:
                    attrs.setdefault("arrays", {})[name] = own
                continue
            where = f"{item.group}/{name}"
            dtype = np.dtype(item.cast_from.get(name, item.dtypes[name]))  # the file's
            offset = item.offsets.get(name)
            if fd is not None and offset is not None:
                arrays[name] = out = np.empty(shape, dtype=dtype)
                _read_at(fd, out, offset)
                if counts is not None:
                    if name in counts:
                        path = where
                        own = hdf5_attrs_at(f.id, path, counts[name], lambda: f[path])  # noqa: B023
                        if own:
                            attrs.setdefault("arrays", {})[name] = own
                    continue
            if gid is None:
                gid = h5py.h5g.open(f.id, item.group.encode())
            did = h5py.h5d.open(gid, name.encode())
            if name not in arrays:
                out = np.empty(shape, dtype=dtype)
                if out.size:
                    did.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
                arrays[name] = out
            own = hdf5_attrs_of(did, lambda: h5py.Dataset(did))  # noqa: B023
            if own:
                attrs.setdefault("arrays", {})[name] = own
        where = item.group
        if counts is None:
            if ITSELF in item.fields.values():  # the item is a dataset
                group_attrs = hdf5_attrs(f[item.group])
            else:
                if gid is None:
                    gid = h5py.h5g.open(f.id, item.group.encode())
                group_attrs = hdf5_attrs_of(gid, lambda: h5py.Group(gid))
        elif "" in counts:
            group_attrs = hdf5_attrs_at(f.id, item.group, counts[""], lambda: f[item.group])
        else:
            group_attrs = {}
        if item.texts:  # string datasets: attributes of the item
            under = f"{item.group}/".lstrip("/")  # a whole file's item: its root
            group_attrs.update(text_attrs(f.id, item.texts, group_attrs, under))
        if group_attrs:
            attrs["attrs"] = group_attrs
    except (OSError, RuntimeError, KeyError) as e:
        raise read_failure(item.source, f, where, e) from None
    for name in item.cast_from:  # as read_array casts: numpy's, range checked
        arrays[name] = cast_values(item.dtypes[name].name, arrays[name], f"'{item.name}/{name}'")
    return arrays, attrs
