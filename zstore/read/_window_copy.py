"""Copying a window out of the pieces (shards or chunks) that cover it, for
:class:`zstore.read.reader.WindowReader`: one window into a new array or a batch slot,
and a batch's pieces indexed by value path so each window looks only at its own."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import numpy as np

from zstore.errors import IntegrityError
from zstore.format import ArrayLayout, Span
from zstore.read._shard_pieces import Lazy, Pieces
from zstore.read.streamcopy import copy_values


def run_all(jobs: list[Callable[[], None]]) -> None:
    """Run a batch's copy jobs in turn (when the caller gives no thread pool)."""
    for job in jobs:
        job()


def copy_into(layout: ArrayLayout, span: Span, index: PathIndex, out: np.ndarray) -> None:
    """One window's copy into its batch slot (a job of
    :meth:`zstore.read.reader.WindowReader.read_batch`)."""
    assemble(layout, span, near(index, layout.path, span), out, stream=True)


#: per value path: its pieces' offsets (sorted), the pieces, and the longest's length
PathIndex = dict[str, tuple[list[int], list[tuple[int, Any]], int]]


def by_path(pieces: Pieces) -> PathIndex:
    """A batch's pieces by value path, in offset order: each window then looks at the
    few that can overlap it, not at every piece of the batch."""
    by: dict[str, list[tuple[int, Any]]] = {}
    for (path, _), (offset, arr) in pieces.items():
        by.setdefault(path, []).append((offset, arr))
    out: PathIndex = {}
    for path, entries in by.items():
        entries.sort(key=lambda e: e[0])
        longest = max(max(arr.shape, default=0) for _, arr in entries)  # >= along time
        out[path] = ([o for o, _ in entries], entries, longest)
    return out


def near(index: PathIndex, path: str, span: Span) -> Pieces:
    """The pieces of ``path`` that can overlap ``span`` (as a :data:`Pieces` dict)."""
    found = index.get(path)
    if found is None:
        return {}
    offsets, entries, longest = found
    lo = bisect.bisect_left(offsets, span.start - longest)
    hi = bisect.bisect_left(offsets, span.stop)
    return {(path, k): entries[k] for k in range(lo, hi)}


def window_shape(layout: ArrayLayout, span: Span | None) -> tuple[int, ...]:
    """The shape of ``span`` of an array: its own, with the window's length along time
    (the whole array's for None: an array stored whole, read next to the windows)."""
    shape = list(layout.shape)
    if span is None:
        return tuple(shape)
    shape[layout.time_axis] = span.stop - span.start + span.pad
    return tuple(shape)


def assemble(
    layout: ArrayLayout,
    span: Span,
    pieces: Pieces,
    out: np.ndarray | None = None,
    stream: bool = False,
) -> np.ndarray:
    """One copy of ``span`` out of the pieces (chunks or shards) that cover it, into
    ``out`` when given (it must have the window's shape and the array's dtype); with
    ``stream`` the copy bypasses the CPU's cache (for a batch slot read later)."""
    axis = layout.time_axis
    shape = window_shape(layout, span)
    if out is None:
        out = np.empty(shape, dtype=layout.dtype)
    elif out.shape != shape or out.dtype != layout.dtype:
        raise ValueError(
            f"'{layout.path}': a window of shape {tuple(shape)} ({layout.dtype}) "
            f"does not fit the batch slot of shape {out.shape} ({out.dtype}); "
            "items of a batch need the same shape apart from time"
        )
    dst = [slice(None)] * len(shape)
    src = [slice(None)] * len(shape)
    parts: list[tuple[int, int]] = []
    for (path, _), (offset, arr) in pieces.items():
        if path != layout.path:
            continue
        lo = max(span.start, offset)
        hi = min(span.stop, offset + arr.shape[axis])
        if lo >= hi:
            continue
        dst[axis] = slice(lo - span.start, hi - span.start)
        src[axis] = slice(lo - offset, hi - offset)
        if isinstance(arr, Lazy):
            arr = arr.decoded()
        copy_values(out[tuple(dst)], arr[tuple(src)], stream=stream)
        parts.append((lo, hi))
    covered = covered_by(parts)
    if covered != span.stop - span.start:  # never hand out np.empty's leftover memory
        raise IntegrityError(
            f"'{layout.path}': the pieces read cover {covered} of the "
            f"{span.stop - span.start} samples of window [{span.start}, "
            f"{span.stop}); this is a bug in zstore, please report it"
        )
    if span.pad:
        dst[axis] = slice(span.stop - span.start, None)
        out[tuple(dst)] = 0
    return out


def covered_by(parts: list[tuple[int, int]]) -> int:
    """Samples in the union of ``[lo, hi)`` intervals (pieces of one value may overlap:
    a shard mapped for one window of a batch and its chunks read for another)."""
    total, end = 0, None
    for lo, hi in sorted(parts):
        if end is not None and lo < end:
            lo = end
        if hi > lo:
            total += hi - lo
        end = hi if end is None else max(end, hi)
    return total
