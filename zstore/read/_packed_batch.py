"""Windows of packed short items, read straight from mapped decoded shards.

A window of a short item is one slice of one shard of its pack group's array, and a
batch of them shares a few shards.  The general path of a batch (per window: a plan,
the shard lookups, an index of the batch's pieces, an assembly checking what the pieces
cover) cost ~50 us of Python a window, more than the copy of a 1 s window.  Here the
batch's placements are looked up at once, each shard once, and each window is one
slice copied into its slot (two where an item ends in the next shard).  It applies
when every window is of a packed item and the RAM tier holds its shards in the decoded
form (mapped here on first use); any other batch takes the general path, before
anything is counted or copied.  The lookups count as
the general path's do: a hit per shard per batch.  One window or whole item
(``ds[i]``) takes the same way (:func:`packed_read`: ~31 us an item, not ~50).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from zstore.format import Span
from zstore.read._ram_shards import DecodedShards
from zstore.read.streamcopy import STREAM_ROW_BYTES as ROW_BYTES
from zstore.read.streamcopy import copy_streamed

if TYPE_CHECKING:
    from zstore.format import ArrayLayout
    from zstore.read.reader import WindowReader

#: one window of one field: (layout, its parts as (shard, start within the shard,
#: samples, start in the slot), samples in all, slot)
Copy = tuple["ArrayLayout", list[tuple[int, int, int, int]], int, np.ndarray]


def packed_read(
    reader: WindowReader, item: str, spans: dict[str, Span | None], position: int | None
) -> dict[str, np.ndarray] | None:
    """One window (or, where a span is None, the whole array) of a packed item whose
    shards are in the tier, each field copied out of them as a batch's windows are;
    None when this path does not serve it (nothing looked up).  The caller holds the
    reader's lock."""
    manifest = reader.manifest
    placement, shapes = manifest.placement, manifest.shapes
    if position is None or placement is None or shapes is None:
        return None
    g = int(placement.group[position])
    if g < 0 or not isinstance(reader.form, DecodedShards):
        return None
    fields = []
    for name, asked in spans.items():
        offsets = placement.offsets.get(name)
        if offsets is None or name not in shapes:
            return None
        o = int(offsets[position])
        layout = reader.pack_layout(manifest.packs[g], name)
        length = int(shapes[name][position][layout.time_axis])
        span = Span(0, length) if asked is None else asked
        if o < 0 or not layout.fast or not 0 <= span.start <= span.stop <= length:
            return None
        fields.append((name, layout, span, _parts(layout, o, span)))
    arrays = _shard_arrays(
        reader.form, [(layout, s) for _, layout, _, parts in fields for s, *_ in parts]
    )
    if arrays is None:
        return None
    out: dict[str, np.ndarray] = {}
    for name, layout, span, parts in fields:
        if len(parts) == 1 and not span.pad:  # most: one slice, copied
            s, lo, n, _ = parts[0]
            index = (slice(None),) * layout.time_axis + (slice(lo, lo + n),)
            out[name] = arrays[(layout.path, s)][index].copy()
            continue
        shape = list(_across(layout))
        shape.insert(layout.time_axis, span.stop - span.start + span.pad)
        out[name] = np.empty(shape, dtype=layout.dtype)
        pieces = [(arrays[(layout.path, s)], lo, n, to) for s, lo, n, to in parts]
        _copy(pieces, span.stop - span.start, out[name], layout.time_axis, stream=False)
    return out


def packed_batch(
    reader: WindowReader,
    windows: Sequence[tuple[str, dict[str, Span | None], int | None]],
    outs: list[dict[str, np.ndarray]],
) -> list[Callable[[], None]] | None:
    """The copies of ``windows`` into ``outs``, their shards looked up (and counted as
    hits); None when the batch is not one this path serves (nothing looked up).  The
    caller holds the reader's lock.  The copies bypass the CPU's cache (batch slots are
    read once the batch is full)."""
    form, manifest = reader.form, reader.manifest
    placement = manifest.placement
    if not isinstance(form, DecodedShards) or placement is None or not windows:
        return None
    positions = [position for _, _, position in windows]
    if any(p is None for p in positions):
        return None
    at = np.asarray(positions, dtype=np.int64)
    groups = placement.group[at]
    if (groups < 0).any():
        return None
    copies: list[Copy] = []
    for name in windows[0][1]:
        planned = _field(reader, name, windows, outs, at, groups)
        if planned is None:
            return None
        copies += planned
    arrays = _shard_arrays(form, [(layout, s) for layout, parts, _, _ in copies for s, *_ in parts])
    if arrays is None:
        return None
    return [
        functools.partial(
            _copy,
            [(arrays[(layout.path, s)], lo, n, to) for s, lo, n, to in parts],
            total,
            out,
            layout.time_axis,
        )
        for layout, parts, total, out in copies
    ]


def _shard_arrays(
    form: DecodedShards, wanted: list[tuple[ArrayLayout, int]]
) -> dict[tuple[str, int], np.ndarray] | None:
    """The decoded arrays of the shards ``wanted`` (each ``(layout, shard)``), by
    ``(layout path, shard)``, each looked up once and counted as a hit; None, nothing
    counted, when the tier lacks one (the general path builds it), or one was dropped or
    failed its check since (the general path sees to it)."""
    shards = {(layout.path, s): (layout, s) for layout, s in wanted}
    keys = {where: form.key(layout, s) for where, (layout, s) in shards.items()}
    if not all(key in form.values.maps or form.ram.holds(key) for key in keys.values()):
        return None
    mapped = form.values.get_many(
        [(keys[where], form.view_of(layout, s)) for where, (layout, s) in shards.items()]
    )
    arrays: dict[tuple[str, int], np.ndarray] = {}
    for (where, (layout, s)), got in zip(shards.items(), mapped):
        found = None if got is None else form.read(layout, s, got, _whole(layout, s))
        arr = None if found is None else found[where][1]
        if not isinstance(arr, np.ndarray):
            return None
        arrays[where] = arr
    return arrays


def _parts(layout: ArrayLayout, offset: int, span: Span) -> list[tuple[int, int, int, int]]:
    """Where ``span`` of an item at ``offset`` in its pack's array lies: ``(shard, start
    within it, samples, start in the window)`` per shard (an item may end in the next)."""
    parts = []
    first, stop = offset + span.start, offset + span.stop
    here = first
    while here < stop:
        s = here // layout.shard
        take = min(stop, (s + 1) * layout.shard) - here
        parts.append((s, here - s * layout.shard, take, here - first))
        here += take
    return parts


def _field(
    reader: WindowReader,
    name: str,
    windows: Sequence[tuple[str, dict[str, Span | None], int | None]],
    outs: list[dict[str, np.ndarray]],
    at: np.ndarray,
    groups: np.ndarray,
) -> list[Copy] | None:
    """Field ``name`` of every window: its shard, where in it, and its slot."""
    manifest = reader.manifest
    offsets = manifest.placement.offsets.get(name) if manifest.placement is not None else None
    if offsets is None or manifest.shapes is None or name not in manifest.shapes:
        return None
    offset = offsets[at]
    if (offset < 0).any():
        return None
    info = manifest.arrays[name]
    shapes = manifest.shapes[name][at]
    lengths = shapes[:, (info.time_axis or 0) % shapes.shape[1]].tolist()
    layouts: dict[int, ArrayLayout] = {}
    out: list[Copy] = []
    for (_, spans, _), slots, g, o, length in zip(
        windows, outs, groups.tolist(), offset.tolist(), lengths
    ):
        span = spans.get(name)
        if span is None or not 0 <= span.start <= span.stop <= length:
            return None  # a whole array, or a window the general path refuses
        layout = layouts.get(g)
        if layout is None:
            layout = layouts[g] = reader.pack_layout(manifest.packs[g], name)
            if not layout.fast:
                return None
        slot, axis = slots[name], layout.time_axis
        n = span.stop - span.start
        if slot.dtype != layout.dtype or slot.shape[axis] != n + span.pad:
            return None  # the general path says what does not fit
        if slot.shape[:axis] + slot.shape[axis + 1 :] != _across(layout):
            return None
        out.append((layout, _parts(layout, int(o), span), n, slot))
    return out


def _across(layout: ArrayLayout) -> tuple[int, ...]:
    """The array's shape but its time axis."""
    return tuple(layout.shape[: layout.time_axis]) + tuple(layout.shape[layout.time_axis + 1 :])


def _whole(layout: ArrayLayout, s: int) -> Span:
    """Shard ``s`` whole (what its blocks' check covers once per process)."""
    return Span(s * layout.shard, min((s + 1) * layout.shard, layout.length))


def _copy(
    parts: list[tuple[Any, int, int, int]], n: int, out: np.ndarray, axis: int, stream: bool = True
) -> None:
    """Each part ``(shard array, start, samples, start in the slot)`` along ``axis``
    into the slot ``out``, whose ``n`` samples they fill; zeros after them.  ``stream``:
    long rows bypass the CPU's cache (a batch slot, read once the batch is full)."""
    head = (slice(None),) * axis  # the axes before time, whole (those after: implied)
    for src, lo, take, to in parts:
        part = src[(*head, slice(lo, lo + take))]
        short = part.strides[-1] == part.itemsize and part.shape[-1] * part.itemsize < ROW_BYTES
        if stream and not short:
            copy_streamed(out[(*head, slice(to, to + take))], part)
        else:  # short rows, or a window read now: numpy's copy
            out[(*head, slice(to, to + take))] = part
    if out.shape[axis] > n:
        out[(*head, slice(n, None))] = 0
