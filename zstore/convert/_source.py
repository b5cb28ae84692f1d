"""Reading the HDF5 source: find items, check them, decide each array's rate.

An *item* is an HDF5 group that directly holds at least one dataset; nested
groups become nested item names (``"spk1/utt3"``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from zstore.convert._rates import inferred
from zstore.errors import SourceError
from zstore.format import ArrayInfo
from zstore.urls import is_url

NUMERIC_KINDS = "biufc"


@dataclass
class SourceItem:
    """One HDF5 group: its datasets' shapes and dtypes."""

    name: str
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, np.dtype]
    nbytes: int
    source: str = ""  # the HDF5 file
    group: str = ""  # the group's path in it (the item name, less any file prefix)
    #: per dataset stored contiguously, uncompressed, in the file itself: the byte
    #: offset of its data (read directly, without HDF5's read machinery)
    offsets: dict[str, int] = field(default_factory=dict)
    #: how many HDF5 attributes each name has ("" for the group), those with any;
    #: None: not known
    with_attrs: dict[str, int] | None = None
    #: the file's (size, mtime_ns, inode) when ``offsets`` were found: they are used
    #: only while the file is unchanged
    identity: tuple[int, int, int] | None = None
    #: arrays that are not a dataset of the group by their own name: name -> (dataset
    #: path below the group, field): a compound dataset's field
    #: (:mod:`zstore.convert._fields`), or a field-less subgroup's dataset
    #: (:mod:`zstore.convert._subgroups`)
    fields: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: arrays cast to another dtype (``dtypes`` now says it): their dtype in the file
    cast_from: dict[str, np.dtype] = field(default_factory=dict)
    #: other files its datasets read (a virtual dataset's sources, external storage),
    #: with their (size, mtime_ns, inode) when scanned (:mod:`zstore.convert._virtual`)
    depends: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    #: string datasets of the group (a transcript, a speaker's name), kept as the
    #: item's attributes (:func:`zstore.format.text_attrs`)
    texts: list[str] = field(default_factory=list)


@dataclass
class SourcePlan:
    """What the converter will write: items, per array name its rate and time axis."""

    items: list[SourceItem]
    arrays: dict[str, ArrayInfo]
    skipped: list[str] = field(default_factory=list)  # "item/array: why"
    #: those of ``skipped`` left out as asked (``--include``/``--exclude``): not warned of
    chosen: list[str] = field(default_factory=list)


#: the group path of an item that is a whole file: one recording per file, its
#: datasets at the file's root
ROOT = "/"


def item_name(group: str, source: str, prefix: str | None = None) -> str:
    """An item's name in the store: its group's path (``<prefix>/<path>`` in a store
    made from several files, ``prefix`` being the file's stem); a file whose datasets
    lie at its root is the item, named by the file's stem (or ``prefix``)."""
    if group == ROOT:
        return prefix if prefix is not None else Path(source.rstrip("/")).stem
    return f"{prefix}/{group}" if prefix is not None else group


#: the most strings a string dataset may hold to be kept as an attribute of its item
#: (a transcript, a list of words or of segment texts); larger ones are left out
MAX_TEXT_VALUES = 4096


def is_text(shape: tuple[int, ...], dtype: np.dtype) -> bool:
    """Whether a dataset is strings an item keeps as an attribute: a string, or a list
    of at most :data:`MAX_TEXT_VALUES` of them."""
    if h5py.check_string_dtype(dtype) is None:
        return False
    return len(shape) == 0 or (len(shape) == 1 and shape[0] <= MAX_TEXT_VALUES)


def non_numeric(dtype: np.dtype) -> str:
    """Why a dataset of ``dtype`` is left out: what it holds, and for ragged arrays
    (variable-length numbers: word or phone alignments) how to store them instead."""
    base = h5py.check_vlen_dtype(dtype)
    if base is not None and np.dtype(base).kind in NUMERIC_KINDS:
        return (
            f"ragged arrays (variable-length {np.dtype(base)}), which no Zarr array holds; "
            "store them as one flat array of the values and one of their offsets, or padded"
        )
    return f"non-numeric dtype {dtype}"


def identity_of(file: int | str) -> tuple[int, int, int]:
    """The (size, mtime_ns, inode) of an open file (its descriptor) or of a path: what
    :attr:`SourceItem.identity` records, so the file is read at the scan's offsets only
    while it is unchanged."""
    st = os.stat(file)
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def check_unchanged(items: list[SourceItem], again: str) -> None:
    """Raise :class:`SourceError` naming the first source file of ``items`` that is no
    longer the file scanned (size, modification time or inode): written to while its
    items were read (HDF5's file locking is often off on cluster file systems), the
    store would hold some items from before the change and some from after.  ``again``
    says how to rerun."""
    scanned: dict[str, tuple[int, int, int]] = {}
    for it in items:
        if it.identity is not None:
            scanned.setdefault(it.source, it.identity)
        for other, was in it.depends.items():  # a virtual dataset's sources, ...
            scanned.setdefault(other, was)
    for path, was in scanned.items():
        try:
            now: tuple[int, int, int] | None = identity_of(path)
        except OSError:
            now = None
        if now != was:
            raise SourceError(
                f"{path}: the file changed while its items were converted (its size, "
                "modification time or inode); the items read from it may mix values from "
                f"before and after the change, so the store is not finished: {again} once "
                "nothing writes the file"
            )


def open_source(src: str | os.PathLike[str]) -> h5py.File:
    """Open the HDF5 file read-only, turning every failure into one clear error (the
    filters of hdf5plugin loaded first, when it is installed)."""
    from zstore.convert._filters import load_filters

    load_filters()
    path = os.fspath(src)
    if is_url(path):  # any fsspec URL: h5py reads the file object
        import fsspec

        try:
            return h5py.File(fsspec.open(path, "rb").open(), "r")
        except FileNotFoundError:
            raise SourceError(f"{path}: no such HDF5 file; check the URL") from None
        except OSError as e:
            raise SourceError(
                f"{path}: cannot be read as HDF5 ({str(e).splitlines()[0]})"
            ) from None
    if not os.path.exists(path):
        raise SourceError(f"{path}: no such HDF5 file; check the path")
    if os.path.getsize(path) == 0:
        raise SourceError(f"{path}: the file is empty (0 bytes); re-copy or regenerate it")
    try:
        return h5py.File(path, "r")
    except OSError as e:
        if "unable to lock file" in str(e):  # errno 11: a writer holds HDF5's lock
            raise SourceError(
                f"{path}: another process has the file open for writing (it holds HDF5's "
                "file lock); convert it once that process has closed it. If nothing "
                "writes it (a lock left on a network file system), set "
                "HDF5_USE_FILE_LOCKING=FALSE: a file changed while it is converted is "
                "still refused"
            ) from None
        with open(path, "rb") as head:
            if head.read(10) == b"MATLAB 5.0":  # MAT-file versions 5-7: not HDF5
                raise SourceError(
                    f"{path}: a MATLAB .mat file of version 5-7, which is not HDF5; save it "
                    "again with save(..., '-v7.3') (HDF5), then convert that"
                ) from None
        raise SourceError(
            f"{path}: cannot be read as HDF5 ({str(e).splitlines()[0]}); the file may be "
            "truncated or corrupt: re-copy it from its source"
        ) from None


def _fewest(items: list[SourceItem], n: str, kind: Any) -> str:
    """The first group of the fewest items alike in array ``n``'s dtype (``kind`` maps a
    dtype to what counts) or, with ``kind`` None, its number of dimensions: the odd
    ones a conversion may leave out."""
    groups: dict[Any, list[str]] = {}
    for it in items:
        if n in it.shapes:
            key = kind(it.dtypes[n]) if kind is not None else len(it.shapes[n])
            groups.setdefault(key, []).append(it.group)
    return min(groups.values(), key=len)[0]


def _check_same_arrays(items: list[SourceItem], src: str) -> list[str]:
    """Every array name; an array may be missing from some items (stored where present),
    but its dtype (byte order aside) and number of dimensions must agree wherever it is."""
    names = sorted({n for it in items for n in it.shapes})
    first = {n: next(it for it in items if n in it.shapes) for n in names}
    for it in items:
        for n in it.shapes:
            ref = first[n]
            # byte order aside: the store holds little-endian values whatever the file's
            if it.dtypes[n].newbyteorder("=") != ref.dtypes[n].newbyteorder("="):
                raise SourceError(
                    f"{src}: '{it.name}/{n}' is {it.dtypes[n]} but '{ref.name}/{n}' is "
                    f"{ref.dtypes[n]}: an array has one dtype in every group of a store; "
                    + (
                        f"give --dtype {n}=float32 (or float64) to store every item's as that"
                        if it.dtypes[n].kind == ref.dtypes[n].kind == "f"
                        else "cast one of them in the HDF5 file, or leave the odd ones out "
                        f"(--exclude '{_fewest(items, n, lambda x: x.newbyteorder('='))}', "
                        "or a pattern of such groups)"
                    )
                )
            if len(it.shapes[n]) != len(ref.shapes[n]):
                raise SourceError(
                    f"{src}: '{it.name}/{n}' has {len(it.shapes[n])} dimensions (shape "
                    f"{it.shapes[n]}) but '{ref.name}/{n}' has {len(ref.shapes[n])} (shape "
                    f"{ref.shapes[n]}): an array has the same number of dimensions in "
                    "every group of a store; reshape one of them in the HDF5 file, or "
                    f"leave the odd ones out (--exclude '{_fewest(items, n, None)}', or a "
                    "pattern of such groups)"
                )
    return names


def time_axes(
    time_axis: int | dict[str, int],
    names: list[str],
    ndims: dict[str, int],
    rates: dict[str, float],
    path: str,
    others: int = -1,
) -> dict[str, int | None]:
    """Each array's time axis (non-negative; None where out of range for an array
    without a rate): ``time_axis`` is one axis for all, or {name: axis} (others
    ``others``)."""
    per = dict(time_axis) if isinstance(time_axis, dict) else {}
    default = others if isinstance(time_axis, dict) else time_axis
    for name, axis in [("", default), *per.items()]:
        if isinstance(axis, bool) or not isinstance(axis, int):
            what = f"{name}={axis!r}" if name else repr(axis)
            raise SourceError(
                f"--time-axis {what}: must be a whole number (-1: last), or NAME=AXIS for one array"
            )
    unknown = [n for n in per if n not in names]
    if unknown:
        raise SourceError(
            f"--time-axis {unknown[0]}=...: {path} has no array named "
            f"'{unknown[0]}' (arrays: {', '.join(names)})"
        )
    out: dict[str, int | None] = {}
    for n in names:
        axis = per.get(n, default)
        ok = ndims[n] and -ndims[n] <= axis < ndims[n]
        if not ok and ndims[n] and (n in rates or n in per):
            shown = f"{n}={axis}" if n in per else str(axis)
            raise SourceError(
                f"--time-axis {shown}: '{n}' has {ndims[n]} dimension(s), so "
                f"its time axis must be from {-ndims[n]} to {ndims[n] - 1}"
            )
        out[n] = axis % ndims[n] if ok else None
    return out


def plan(
    src: str | os.PathLike[str] | list[str],
    rates: dict[str, float | None] | None,
    time_axis: int | dict[str, int] = -1,
    optional: bool = False,
    pool: Any = None,
    dataset_items: str | None = None,
    casts: dict[str, str] | None = None,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    subgroups: str = "items",
    other_axes: int = -1,
) -> SourcePlan:
    """Scan the source file(s) and decide the rate of every array; raise on
    contradictions.  ``pool``: worker processes that may share the scan of a large
    file (:func:`zstore.convert._scan.scan`).  ``rates`` maps a name to samples per second, or to None for an
    array to store whole (no time axis) whatever its shape.  ``optional``: ``rates`` and
    a ``time_axis`` dict may name arrays the files lack (an append's new items need not
    have every array of the store).  ``dataset_items``: an array name; every dataset is
    then an item holding that one array (a file of one dataset per recording).
    ``casts``: {array: float dtype} the store keeps (:mod:`zstore.convert._casts`).
    ``include``/``exclude``: patterns of the items taken (:mod:`zstore.convert._select`).
    ``subgroups``: groups inside an item's group are ``"items"`` of their own or hold
    ``"arrays"`` of it (:mod:`zstore.convert._subgroups`).  ``other_axes``: the time
    axis of arrays a ``time_axis`` dict does not name.

    A time axis is a claim: an array gets a rate when ``rates`` gives it, or when it has
    the same whole-number length ratio to a given one in items of at least two lengths
    (:func:`_implied_ratio`).  Any other array is stored whole, and its note says why
    and which ``--rate`` to give if it is a time array."""
    files = [os.fspath(src)] if isinstance(src, (str, os.PathLike)) else list(src)
    path = files[0] if len(files) == 1 else f"{len(files)} sources ({files[0]}, ...)"
    from zstore.convert._scan import scan_all  # it builds on this module
    from zstore.convert._select import select
    from zstore.convert._skipped import summarize

    items, left = scan_all(files, pool, dataset_items, subgroups, frozenset(rates or {}))
    items, unselected = select(items, include, exclude, path)
    skipped = summarize(left) + unselected  # one line per kind of thing left out
    if casts:
        from zstore.convert._casts import apply_casts  # it builds on this module

        apply_casts(items, casts, path, optional)
    names = _check_same_arrays(items, path)
    given = dict(rates or {})
    if optional:
        given = {n: r for n, r in given.items() if n in names}
        if isinstance(time_axis, dict):
            time_axis = {n: a for n, a in time_axis.items() if n in names}
    static = {n for n, r in given.items() if r is None}
    rated: dict[str, float] = {n: r for n, r in given.items() if r is not None}
    for name in given:
        if name not in names:
            raise SourceError(
                f"--rate {name}=...: {path} has no array named '{name}' "
                f"(arrays: {', '.join(names)})"
            )
    for name, rate in rated.items():
        if (
            isinstance(rate, bool)
            or not isinstance(rate, (int, float))
            or not math.isfinite(rate)
            or rate <= 0
        ):
            raise SourceError(
                f"--rate {name}={rate}: a rate must be a positive, finite "
                "number of samples per second (e.g. 16000), or 'none' to "
                "store the array whole"
            )
    ndims = {n: len(next(it for it in items if n in it.shapes).shapes[n]) for n in names}
    axes = time_axes(time_axis, names, ndims, rated, path, other_axes)
    arrays: dict[str, ArrayInfo] = {}
    for n in names:
        if n in rated:
            if ndims[n] == 0:
                raise SourceError(f"--rate {n}=...: '{n}' is a scalar, it has no time axis")
            arrays[n] = ArrayInfo(float(rated[n]), axes[n])
    _check_rates(items, arrays, path)
    for n in names:
        if n in arrays:
            continue
        if n in static:
            arrays[n] = ArrayInfo(None, None, note=f"stored whole, as asked (--rate {n}=none)")
        else:
            arrays[n] = inferred(n, items, arrays, axes.get(n), ndims[n])
    from zstore.convert._rate_attrs import check_rate_attrs  # it builds on this module

    check_rate_attrs(items, arrays, path)
    if not any(a.rate for a in arrays.values()):
        first = max(  # the example: the largest item, not an empty or truncated one
            items, key=lambda it: sum(math.prod(sh) for sh in it.shapes.values())
        )
        names = [n for n in names if n in first.shapes]
        shapes = ", ".join(f"{n} {first.shapes[n]}" for n in names)

        def length(n: str) -> int:
            axis = axes.get(n)
            return first.shapes[n][axis] if first.shapes[n] and axis is not None else 0

        # the longest; of those, the one most items have (wav, not one item's time scale)
        longest = max(
            names,
            key=lambda n: (
                length(n),
                sum(n in it.shapes for it in items),
                math.prod(first.shapes[n]),
            ),
        )
        raise SourceError(
            f"{path}: no --rate given, so no array has a time axis and no window could be "
            f"read; give the time arrays' rates in samples per second, e.g. "
            f"--rate {longest}=16000 (arrays of '{first.name}': {shapes}; arrays with a "
            "whole-number length ratio to a rated one in items of different lengths get "
            "their rate inferred)"
            + (
                f"; or, if each dataset of '{first.name}' is a recording of its own, give "
                "--dataset-items wav (naming the array)"
                if len(names) >= 4 and len(names) > 2 * len(items)
                else ""
            )
        )
    from zstore.convert._dims import dimension_names  # it reads the file through this module

    dims = dimension_names(items, arrays)
    arrays = {n: dataclasses.replace(a, dims=dims.get(n)) for n, a in arrays.items()}
    return SourcePlan(items, arrays, skipped, unselected)


#: how many values of the slower of two time arrays their durations may differ by:
#: framed features lose frames at the edges (Kaldi's ``snip_edges``: 1 + (N - win) //
#: hop frames, win / hop of them, up to 4-8 with long windows) or gain one (centred
#: frames); windows are drawn within what every array covers, aligned by their starts
EDGE_VALUES = 8


def _check_rates(items: list[SourceItem], arrays: dict[str, ArrayInfo], src: str) -> None:
    """Every item's rated time arrays must last the same, within :data:`EDGE_VALUES`
    values of the slower: else a rate or a time axis is wrong."""
    rated = [(n, a) for n, a in arrays.items() if a.rate is not None and a.time_axis is not None]
    for it in items:
        for i, (a, ia) in enumerate(rated):
            for b, ib in rated[i + 1 :]:
                if a not in it.shapes or b not in it.shapes:
                    continue
                ra, rb = float(ia.rate or 1), float(ib.rate or 1)
                da = it.shapes[a][ia.time_axis or 0] / ra
                db = it.shapes[b][ib.time_axis or 0] / rb
                slack = EDGE_VALUES / min(ra, rb) + 1e-9
                if abs(da - db) > slack:
                    raise SourceError(
                        f"{src}: group '{it.name}': '{a}' lasts {da:.3f} s at {ia.rate:g}/s "
                        f"but '{b}' lasts {db:.3f} s at {ib.rate:g}/s (more than "
                        f"{EDGE_VALUES} values of the slower apart); check the rates or "
                        "the time axis (--time-axis)"
                    )
