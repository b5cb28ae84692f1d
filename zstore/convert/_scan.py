"""Scanning an HDF5 source: its items, what is left out, and where their data lies.

The scan is the one serial step of a conversion, and on a corpus of short items it cost
as much as writing them (10,000 items of 0.1-1 s: 2.1 s of a 4.8 s conversion with 2
workers).  One visit of the file's links lists the names; describing the objects
behind them (HDF5 reads each one's header: ~15 us a group, ~70 us a dataset) is shared
with the conversion's worker processes when the file is large and local, the scanning
process taking tasks back from the end of the queue while the workers start.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
from typing import Any

import h5py
import numpy as np

from zstore.convert._dataset_items import dataset_items as _dataset_items
from zstore.convert._fields import SEPARATOR, numeric_fields
from zstore.convert._source import (
    MAX_TEXT_VALUES,
    NUMERIC_KINDS,
    ROOT,
    SourceItem,
    identity_of,
    is_text,
    item_name,
    non_numeric,
    open_source,
)
from zstore.convert._subgroups import merge_subgroups, nested_items
from zstore.convert._tasks import task_result
from zstore.convert._virtual import OtherFiles, Others, other_files
from zstore.errors import SourceError
from zstore.urls import is_url

#: A described object: (HDF5 object type, address, number of attributes, and for a
#: dataset its shape, dtype, data offset when contiguous, and the other files it reads:
#: :mod:`zstore.convert._virtual`); None where nothing is there (a dangling soft link).
Row = tuple[int, int, int, tuple[int, ...] | None, np.dtype | None, int | None, Others] | None

#: A link in the order of one visit of the file: (path, link type, the object behind
#: it; None for an external link).
Link = tuple[bytes, int, Row]

#: files smaller than this are scanned by the scanning process alone (a task's round
#: trip and file open would cost more than they share)
SHARED_BYTES = 16 * 2**20
#: the file's root-level links are shared out in about this many tasks
SHARED_TASKS = 32
#: root groups of MATLAB's version 7.3 .mat files (HDF5) that hold its own bookkeeping:
#: the data cell arrays and strings refer to, and class definitions
MATLAB_GROUPS = frozenset({"#refs#", "#subsystem#"})


def matlab_chars(
    fid: Any, found: list[tuple[str, tuple[int, ...], np.dtype]], attrs: dict[str, int]
) -> set[str]:
    """The datasets of ``found`` that are MATLAB ``char`` arrays (a .mat file of version
    7.3 keeps a string as UTF-16 codes, ``uint16`` with the attribute
    ``MATLAB_class="char"``): a label, a transcript, kept as text attributes of their
    items (:func:`zstore.format.attrs.text_attrs`).  Only 2-D ``uint16`` datasets with
    attributes are asked (~25 us each)."""
    out = set()
    for full, shape, dtype in found:
        # stored (columns, rows): a string per row, at most MAX_TEXT_VALUES of them
        if dtype != np.uint16 or len(shape) != 2 or shape[1] > MAX_TEXT_VALUES:
            continue
        if not attrs.get(full):
            continue
        where = full.encode("utf-8", "surrogateescape")
        try:
            aid = h5py.h5a.open(fid, b"MATLAB_class", obj_name=where)
        except KeyError:
            continue
        value = np.empty((), dtype=aid.dtype)  # fixed-length bytes as MATLAB writes it
        aid.read(value)
        got = value.item()
        if (got.decode("ascii", "replace") if isinstance(got, bytes) else str(got)) == "char":
            out.add(full)
    return out


#: sources whose failure a corpus's one error lists in full (the rest are counted)
MAX_FAILED = 10


def scan_all(
    files: list[str],
    pool: Any = None,
    dataset_items: str | None = None,
    subgroups: str = "items",
    rated: frozenset[str] = frozenset(),
) -> tuple[list[SourceItem], list[str]]:
    """The items of every file; with several, named ``<file stem>/<group path>``.
    ``rated``: the arrays given a rate (see :func:`scan`)."""
    from zstore.convert._corpus import stems

    if len(files) == 1:
        return scan(files[0], pool, dataset_items, subgroups, rated)
    prefix = stems(files)
    items: list[SourceItem] = []
    skipped: list[str] = []
    failed: list[str] = []  # every file that cannot be converted, named in one error
    for f in files:
        try:
            found, left = scan(f, pool, dataset_items, subgroups, rated)
        except SourceError as e:
            failed.append(str(e))
            continue
        for it in found:
            it.name = item_name(it.group, f, prefix[f])
        items += found
        skipped += [f"{prefix[f]}:{s}" for s in left]
    if failed:
        shown = "".join(f"\n  {m}" for m in failed[:MAX_FAILED])
        more = f"\n  and {len(failed) - MAX_FAILED} more" if len(failed) > MAX_FAILED else ""
        raise SourceError(
            f"{len(failed)} of {len(files)} sources cannot be converted; fix or re-copy "
            f"them, or leave them out of the sources given:{shown}{more}"
        )
    items.sort(key=lambda it: it.name)
    return items, skipped


def scan(
    src: str | os.PathLike[str],
    pool: cf.Executor | None = None,
    dataset_items: str | None = None,
    subgroups: str = "items",
    rated: frozenset[str] = frozenset(),
) -> tuple[list[SourceItem], list[str]]:
    """List the items of ``src`` and what is left out, with why: non-numeric datasets,
    external and dangling links, and groups reached under a second name (aliases).
    A file whose datasets all lie at its root, one of them an array of ``rated`` (the
    arrays given a rate: ``wav``), is one recording, its item named by the file's stem;
    datasets at the root named otherwise (utterance ids: a file of one dataset per
    recording) are not taken for one recording's arrays.
    With ``dataset_items`` (an array name), every numeric dataset is an item of its own
    holding one array of that name (a file of one dataset per recording).
    ``subgroups``: whether groups inside an item's group are items of their own
    (``"items"``) or hold arrays of that item (``"arrays"``; :mod:`zstore.convert._subgroups`).

    Uses h5py's low-level API: one visit of the file's links, then each object's header
    opened once (about 4x faster than the high-level ``visititems``, which builds a
    Group or Dataset object for every name; small items are mostly scan).  ``pool``:
    worker processes that walk parts of a large local file beside this one."""
    items: list[SourceItem] = []
    skipped: list[str] = []
    path = os.fspath(src)
    identity = None
    with open_source(path) as f:
        if not is_url(path):  # the file as scanned: its datasets' offsets hold for it
            identity = _identity(f)

        try:
            if pool is not None and identity is not None and identity[0] >= SHARED_BYTES:
                links = _walk_shared(f.id, path, identity, pool)
            else:
                links = walk(f.id)
            found, left, aliases, direct, attrs, others = _datasets(f.id, links)
            chars = matlab_chars(f.id, found, attrs)
        except (OSError, RuntimeError, KeyError) as e:
            raise SourceError(
                f"{path}: reading the file failed ({e}); it may be truncated or corrupt: re-copy it"
            ) from None
    skipped += left
    skipped += [
        f"{alias}: the same group as '{target}' (a link): converted once, as '{target}'"
        for alias, target in sorted(aliases.items())
    ]
    files = OtherFiles(path) if others and not is_url(path) else None
    if files is not None:
        found = _with_their_sources(found, others, files, skipped)
    if dataset_items is not None:
        items, left = _dataset_items(found, dataset_items, path, identity, attrs)
        skipped += left
        if not items:
            raise SourceError(f"{path}: holds no numeric datasets; nothing to convert")
        return _depending(items, others, files), skipped
    groups: dict[str, list[tuple[str, tuple[int, ...], np.dtype]]] = {}
    split: dict[str, dict[str, tuple[str, str]]] = {}  # group -> its compound fields
    texts: dict[str, list[tuple[str, np.dtype]]] = {}  # group -> its string datasets
    paths = {full for full, _, _ in found}
    # a file whose datasets all lie at its root (one recording per file, written as
    # f["wav"] = ...) is one item, its root the item's group
    whole_file = all("/" not in full for full in paths) and bool(rated & paths)
    for full, shape, dtype in found:
        group, _, key = full.rpartition("/")
        fields = numeric_fields(dtype)
        if not group and not whole_file:
            skipped.append(f"/{key}: dataset at the file's root, not in a group")
        elif fields is not None:  # a table of records: one array per field
            names = [f"{key}{SEPARATOR}{field}" for field, _ in fields]
            clash = next((n for n in names if f"{group}/{n}" in paths), None)
            if clash is not None:
                skipped.append(
                    f"{group}/{key}: compound dtype {dtype}, whose field would be "
                    f"'{clash}', the name of another dataset"
                )
                continue
            for array, (field, fdtype) in zip(names, fields):
                groups.setdefault(group, []).append((array, shape, fdtype))
                split.setdefault(group, {})[array] = (key, field)
        elif is_text(shape, dtype) or full in chars:  # a transcript: an item attribute
            texts.setdefault(group, []).append((key, dtype))
        elif h5py.check_string_dtype(dtype) is not None:
            skipped.append(
                f"{group}/{key}: strings ({dtype}), more than one list of "
                f"{MAX_TEXT_VALUES} to keep as an attribute of the item"
            )
        elif dtype.kind not in NUMERIC_KINDS or dtype.names:
            skipped.append(f"{group}/{key}: {non_numeric(dtype)}")
        else:
            groups.setdefault(group, []).append((key, shape, dtype))
    for internal in [g for g in groups if g.split("/", 1)[0] in MATLAB_GROUPS]:
        del groups[internal]
        split.pop(internal, None)
        skipped.append(
            f"{internal}: MATLAB's store of the data that cell arrays and strings refer to "
            "(a .mat file of version 7.3), not a recording"
        )
    nested_items(path, set(groups), subgroups)
    if subgroups == "arrays":
        merge_subgroups(groups, split, skipped)
    for name, arrays in groups.items():
        arrays.sort(key=lambda a: a[0])
        where = {k: direct.get(f"{name}/{k}" if name else k) for k, _, _ in arrays}
        group = name or ROOT
        items.append(
            SourceItem(
                item_name(group, path),
                {k: s for k, s, _ in arrays},
                {k: d for k, _, d in arrays},
                sum(math.prod(s) * d.itemsize for _, s, d in arrays),
                path,
                group,
                {k: o for k, o in where.items() if o is not None},
                None  # the root's own attributes are not counted by the visit
                if not name
                else {
                    k: attrs[at]
                    for k in ("", *(a[0] for a in arrays))
                    if (at := f"{name}/{k}".rstrip("/")) in attrs
                },
                identity,
                split.get(name, {}),
                texts=sorted(k for k, _ in texts.get(name, [])),
            )
        )
    for group, kept in texts.items():  # no item to keep them: left out, as others
        if group not in groups:
            skipped += [
                f"{group}/{key}: strings ({dtype}) in a group that is not an item"
                for key, dtype in kept
            ]
    if not items:
        root = sorted(full for full, _, d in found if "/" not in full and d.kind in NUMERIC_KINDS)
        at_root, first_root = len(root), root[0] if root else "wav"
        raise SourceError(
            f"{path}: holds no groups with numeric datasets; nothing to convert"
            + (
                f" (its {at_root} numeric dataset(s) are at the file's root: for a file of "
                "one dataset per recording give --dataset-items wav, naming the array; for "
                "a file of one recording, its arrays at the root, give its audio's rate: "
                f"--rate {first_root}=16000)"
                if at_root
                else ""
            )
        )
    items.sort(key=lambda it: it.name)
    return _depending(items, others, files), skipped


def _with_their_sources(
    found: list[tuple[str, tuple[int, ...], np.dtype]],
    others: dict[str, Others],
    files: OtherFiles,
    skipped: list[str],
) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """``found`` less the virtual datasets that would read fill values for a missing
    source (each named in ``skipped``)."""
    kept = []
    for full, shape, dtype in found:
        why = files.missing(others.get(full, ()))
        if why is None:
            kept.append((full, shape, dtype))
        else:
            skipped.append(
                f"{full}: a virtual dataset whose {why}: it would read as its fill value "
                "(zeros), not the recording; restore the file to convert it"
            )
    return kept


def _depending(
    items: list[SourceItem], others: dict[str, Others], files: OtherFiles | None
) -> list[SourceItem]:
    """``items``, each with the other files its datasets read and their identities
    (:attr:`SourceItem.depends`)."""
    if files is None:
        return items
    by_group = {it.group: it for it in items}
    for full, files_of in others.items():
        # the item is the dataset itself (--dataset-items) or a group above it
        parts = full.split("/")
        for depth in range(len(parts), -1, -1):  # depth 0: a whole file's item
            it = by_group.get("/".join(parts[:depth]) if depth else ROOT)
            if it is not None:
                it.depends.update(files.identities(files_of))
                break
    return items


def _identity(f: h5py.File) -> tuple[int, int, int] | None:
    """The open file's (size, mtime_ns, inode), or None when HDF5 does not read it
    through a plain file descriptor."""
    try:
        return identity_of(f.id.get_vfd_handle())
    except (OSError, TypeError, ValueError):
        return None


def _datasets(
    fid: Any, links: list[Link]
) -> tuple[
    list[tuple[str, tuple[int, ...], np.dtype]],
    list[str],
    dict[str, str],
    dict[str, int],
    dict[str, int],
    dict[str, Others],
]:
    """(path, shape, dtype) of every dataset in the file, what was left out and why, the
    groups reached under a second name (alias -> the name it is converted under), the
    byte offsets of datasets stored contiguously in the file, how many attributes each
    object that has any has, and the other files a dataset reads (virtual datasets,
    external storage), by path.

    Takes the file's ``links`` as one visit lists them, each once: a group hard-linked
    under several names is converted under its first name in name order and the others
    are aliases; a soft link to a dataset is that dataset under the link's name, one to
    a group an alias; external and dangling links are left out, named with their
    target.  Links below an alias are passed over (a walk in parts lists them)."""
    datasets: list[tuple[str, tuple[int, ...], np.dtype]] = []
    skipped: list[str] = []
    aliases: dict[str, str] = {}
    groups: dict[int, str] = {}
    direct: dict[str, int] = {}
    attrs: dict[str, int] = {}
    others: dict[str, Others] = {}
    below: bytes | None = None  # the path of the alias whose links are passed over
    for raw, kind, row in links:
        if below is not None:
            if raw.startswith(below):
                continue
            below = None
        name = raw.decode("utf-8", "surrogateescape")
        if kind == h5py.h5l.TYPE_EXTERNAL:
            target_file, target = (
                x.decode("utf-8", "surrogateescape") for x in fid.links.get_val(raw)
            )
            skipped.append(
                f"{name}: external link to {target_file}:{target} (not followed: "
                "give that file as a source too)"
            )
            continue
        if row is None:
            target = (
                fid.links.get_val(raw).decode("utf-8", "surrogateescape")
                if kind == h5py.h5l.TYPE_SOFT
                else "?"
            )
            skipped.append(f"{name}: soft link to {target}, which does not exist")
            continue
        kind_of, addr, num_attrs, shape, dtype, offset, reads = row
        if num_attrs:
            attrs[name] = num_attrs
        if kind_of == h5py.h5o.TYPE_GROUP:
            if addr in groups:
                aliases[name] = groups[addr]
                below = raw + b"/"
            elif kind == h5py.h5l.TYPE_SOFT:  # the group is reached under its own name
                target = fid.links.get_val(raw).decode("utf-8", "surrogateescape")
                aliases[name] = target.strip("/")
            else:
                groups[addr] = name
        elif kind_of == h5py.h5o.TYPE_DATASET:
            assert shape is not None and dtype is not None
            datasets.append((name, shape, dtype))
            if offset is not None:
                direct[name] = offset
            if reads:
                others[name] = reads
    return datasets, skipped, aliases, direct, attrs, others


def walk(fid: Any, tops: list[tuple[bytes, int]] | None = None) -> list[Link]:
    """The links of the file in the h5py file id ``fid`` (or only the root-level links
    ``tops``, each ``(name, link type)``, and the links below them), each with its
    :data:`Row`, in the order of one visit of the file: depth first, in name order."""
    if tops is None:
        found: list[tuple[bytes, int]] = []
        fid.links.visit(lambda name, info: found.append((name, info.type)), info=True)
        return _described(fid, found)
    out: list[Link] = []
    for link in _described(fid, tops):
        out.append(link)
        name, kind, obj = link
        if kind == h5py.h5l.TYPE_HARD and obj is not None and obj[0] == h5py.h5o.TYPE_GROUP:
            below: list[tuple[bytes, int]] = []
            at = name + b"/"
            gid = h5py.h5g.open(fid, name)  # held: its link proxy does not hold it
            gid.links.visit(
                lambda n, info: below.append((at + n, info.type)),  # noqa: B023 (called here)
                info=True,
            )
            out += _described(fid, below)
    return out


def _described(fid: Any, links: list[tuple[bytes, int]]) -> list[Link]:
    """``links`` with their :data:`Row` (external links: None, not followed)."""
    rows = iter(objects(fid, [name for name, kind in links if kind != h5py.h5l.TYPE_EXTERNAL]))
    return [
        (name, kind, None if kind == h5py.h5l.TYPE_EXTERNAL else next(rows)) for name, kind in links
    ]


def objects(fid: Any, names: list[bytes]) -> list[Row]:
    """Each name's :data:`Row` in the h5py file id ``fid``."""
    out: list[Row] = []
    last: tuple[Any, np.dtype] | None = None  # a file's datasets mostly share a type
    for raw in names:
        try:
            info = h5py.h5o.get_info(fid, raw)
        except (KeyError, RuntimeError, OSError):
            out.append(None)  # a soft link to nothing
            continue
        if info.type != h5py.h5o.TYPE_DATASET:
            out.append((info.type, info.addr, info.num_attrs, None, None, None, ()))
            continue
        ds = h5py.h5d.open(fid, raw)
        tid = ds.get_type()
        if last is None or not tid == last[0]:  # H5Tequal: the same type, the same dtype
            last = (tid, tid.dtype)
        shape = ds.shape
        offset = _contiguous(ds, shape, last[1])
        reads = other_files(ds) if offset is None else ()
        out.append((info.type, info.addr, info.num_attrs, shape, last[1], offset, reads))
    return out


def walk_part(
    path: str, identity: tuple[int, int, int], tops: list[tuple[bytes, int]]
) -> list[Link]:
    """A worker's share of a scan: :func:`walk` of the root-level links ``tops`` of the
    file at ``path``, which must still be the file scanned (``identity``)."""
    with open_source(path) as f:
        if _identity(f) != identity:
            raise SourceError(
                f"{path}: the file changed while it was being scanned; convert it again "
                "once nothing writes it"
            )
        return walk(f.id, tops)


def _walk_shared(
    fid: Any, path: str, identity: tuple[int, int, int], pool: cf.Executor
) -> list[Link]:
    """:func:`walk` of the whole file in tasks of root-level links for ``pool``'s
    workers; this process takes the tasks no worker has started yet, from the last one
    back.  A group linked under two root-level names is walked under both (each task
    walks its own links); :func:`_datasets` passes over the second."""
    tops: list[tuple[bytes, int]] = []
    fid.links.iterate(lambda name, info: tops.append((name, info.type)), info=True)
    size = max(1, math.ceil(len(tops) / SHARED_TASKS))
    parts = [tops[i : i + size] for i in range(0, len(tops), size)]
    futures = [pool.submit(walk_part, path, identity, part) for part in parts]
    done: list[list[Link] | None] = [None] * len(parts)
    for i in reversed(range(len(parts))):
        if futures[i].cancel():
            done[i] = walk(fid, parts[i])
    out: list[Link] = []
    for part, mine, future in zip(parts, done, futures):
        if mine is None:
            try:
                mine = task_result(future)
            except cf.BrokenExecutor:  # a worker died: the scan goes on here, the
                mine = walk(fid, part)  # writing reports the pool's failure
        out += mine
    return out


def _contiguous(ds: Any, shape: tuple[int, ...], dtype: np.dtype) -> int | None:
    """The file offset of a dataset's data when it is stored contiguously in the file
    itself, every byte of it written (no chunks, filters or external files); else None."""
    try:  # HDF5 has no offset for chunked, compact, virtual or external storage
        offset = ds.get_offset()
        nbytes = math.prod(shape) * dtype.itemsize
        if offset is None or not nbytes or ds.get_storage_size() != nbytes:
            return None
        return int(offset)
    except (OSError, RuntimeError, ValueError, TypeError):
        return None
