"""Windows of packed short items, read straight from mapped decoded shards.

A window of a short item is one slice of one shard of its pack group's array, and a
batch of them shares a few shards.  The general path of a batch (per window: a plan,
the shard lookups, an index of the batch's pieces, an assembly checking what the pieces
cover) cost ~50 us of Python a window, more than the copy of a 1 s window.  Here the
batch's placements are looked up at once, each shard once, and each field's windows are
copied by one call of :func:`zstore.read.streamcopy.gather` (a table of slices: one per
window, two where an item ends in the next shard; zeros after an item's end), ~19 us a
window in all against ~28 with a numpy copy per window.  It applies when every window
is of a packed item and the RAM tier holds its shards in the decoded form (mapped here
on first use); any other batch takes the general path, before anything is counted or
copied.  The lookups count as the general path's do: a hit per shard per batch.  One
window or whole item (``ds[i]``) takes the same way (:func:`packed_read`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from zstore.format import Span
from zstore.read import streamcopy
from zstore.read._ram_shards import DecodedShards

if TYPE_CHECKING:
    from zstore.format import ArrayLayout
    from zstore.read.reader import WindowReader

SPLIT_BYTES = 8 << 20  # a field's slots over this are copied in several calls
SPLIT_WINDOWS = 8  # slots per call then (the calls spread over the copy threads)


class Field(NamedTuple):
    """The copies of one field's windows, as :func:`streamcopy.gather` takes them:
    ``rows`` ``(slot, src, start in the src, samples, start in the slot)`` and ``pads``
    ``(slot, first zero)``; ``srcs`` numbers the shards they read, by ``(array path,
    shard)``: ``(number, layout, shard)``."""

    slots: list[np.ndarray]
    srcs: dict[tuple[str, int], tuple[int, ArrayLayout, int]]
    rows: list[tuple[int, int, int, int, int]]
    pads: list[tuple[int, int]]
    axis: int


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
    out: dict[str, np.ndarray] = {}
    fields: list[Field] = []
    slices: list[tuple[str, ArrayLayout, int, slice]] = []  # most: one slice, copied
    for name, asked in spans.items():
        if reader.in_record(position, name):  # an array stored whole
            out[name] = reader.records.array(position, name).copy()
            continue
        offsets = placement.offsets.get(name)
        if offsets is None or name not in shapes:
            return None
        o = int(offsets[position])
        layout = reader.pack_layout(manifest.packs[g], name)
        length = int(shapes[name][position][layout.time_axis])
        span = Span(0, length) if asked is None else asked
        if o < 0 or not layout.fast or not 0 <= span.start <= span.stop <= length:
            return None
        s, lo = divmod(o + span.start, layout.shard)
        if not span.pad and lo + span.stop - span.start <= layout.shard:
            slices.append((name, layout, s, slice(lo, lo + span.stop - span.start)))
            continue
        shape = list(_across(layout))
        shape.insert(layout.time_axis, span.stop - span.start + span.pad)
        out[name] = np.empty(shape, dtype=layout.dtype)
        field = _plan([(layout, o, span, out[name])])
        if field is None:
            return None
        fields.append(field)
    wanted = [(layout, s) for _, layout, s, _ in slices]
    wanted += [(layout, s) for f in fields for _, layout, s in f.srcs.values()]
    arrays = _shard_arrays(reader.form, wanted)
    if arrays is None:
        return None
    for name, layout, s, part in slices:
        src = arrays[(layout.path, s)][(slice(None),) * layout.time_axis + (part,)]
        out[name] = np.empty(src.shape, dtype=layout.dtype)
        streamcopy.copy_values(out[name], src)  # int16 samples in the tier widened
    for f in fields:  # read right away: not streamed past the CPU's cache
        streamcopy.gather(f.slots, _srcs(f, arrays), *_tables(f), f.axis, stream=False)
    return {name: out[name] for name in spans}  # in the order asked


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
    fields: list[Field] = []
    whole: list[str] = []  # arrays stored whole, in the batch records
    for name in windows[0][1]:
        if reader.in_record(positions[0], name):
            whole.append(name)
            continue
        field = _field(reader, name, windows, outs, at, groups)
        if field is None:
            return None
        fields.append(field)
    wanted = [(layout, s) for f in fields for _, layout, s in f.srcs.values()]
    arrays = _shard_arrays(form, wanted)
    if arrays is None:
        return None
    jobs = [job for f in fields for job in _jobs(f, arrays)]
    if whole:  # looked up now, under the reader's lock; copied with the rest
        values = [{n: reader.records.array(int(p), n) for n in whole} for p in at]
        jobs.append(functools.partial(_record_values, values, outs))
    return jobs


def _record_values(values: list[dict[str, np.ndarray]], outs: list[dict[str, np.ndarray]]) -> None:
    """Copy each window's arrays stored whole (from its batch record) into ``outs``."""
    for got, out in zip(values, outs):
        for name, value in got.items():
            out[name][...] = value


def _jobs(f: Field, arrays: dict[tuple[str, int], np.ndarray]) -> list[Callable[[], None]]:
    """The copies of field ``f``: one call of :func:`streamcopy.gather`, or one per
    ``SPLIT_WINDOWS`` slots where the slots hold more than ``SPLIT_BYTES``."""
    srcs, (rows, pads) = _srcs(f, arrays), _tables(f)
    if sum(slot.nbytes for slot in f.slots) <= SPLIT_BYTES:
        return [functools.partial(streamcopy.gather, f.slots, srcs, rows, pads, f.axis)]
    jobs: list[Callable[[], None]] = []
    for first in range(0, len(f.slots), SPLIT_WINDOWS):
        last = first + SPLIT_WINDOWS
        mine = rows[(rows[:, 0] >= first) & (rows[:, 0] < last)]
        pad = pads[(pads[:, 0] >= first) & (pads[:, 0] < last)]
        mine[:, 0] -= first
        pad[:, 0] -= first
        gather = functools.partial(streamcopy.gather, f.slots[first:last], srcs, mine, pad)
        jobs.append(functools.partial(gather, f.axis))
    return jobs


def _srcs(f: Field, arrays: dict[tuple[str, int], np.ndarray]) -> list[np.ndarray]:
    return [arrays[where] for where in f.srcs]


def _tables(f: Field) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.array(f.rows, dtype=np.int64).reshape(-1, 5),
        np.array(f.pads, dtype=np.int64).reshape(-1, 2),
    )


def _shard_arrays(
    form: DecodedShards, wanted: list[tuple[ArrayLayout, int]]
) -> dict[tuple[str, int], np.ndarray] | None:
    """The decoded arrays of the shards ``wanted`` (each ``(layout, shard)``), by
    ``(layout path, shard)``, each looked up once and counted as a hit; None, nothing
    counted, when the tier lacks one (the general path builds it), or one was dropped or
    failed its check since (the general path sees to it)."""
    shards = {(layout.path, s): (layout, s) for layout, s in wanted}
    keys = [form.key(layout, s) for layout, s in shards.values()]
    maps = form.values.maps
    if form.ram.lacks([key for key in keys if key not in maps]):  # one index query
        return None
    mapped = form.values.get_many(
        [(key, form.view_of(layout, s)) for key, (layout, s) in zip(keys, shards.values())]
    )
    arrays: dict[tuple[str, int], np.ndarray] = {}
    for (where, (layout, s)), got in zip(shards.items(), mapped):
        if got is not None and got.checked.complete:  # its blocks checked already
            arr = got.view
        else:
            found = None if got is None else form.read(layout, s, got, _whole(layout, s))
            arr = None if found is None else found[where][1]
        if not isinstance(arr, np.ndarray):
            return None
        arrays[where] = arr
    return arrays


def _field(
    reader: WindowReader,
    name: str,
    windows: Sequence[tuple[str, dict[str, Span | None], int | None]],
    outs: list[dict[str, np.ndarray]],
    at: np.ndarray,
    groups: np.ndarray,
) -> Field | None:
    """Field ``name`` of every window: its shards, where in them, and its slot."""
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
    planned = []
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
        planned.append((layout, o, span, slots[name]))
    return _plan(planned)


def _plan(windows: list[tuple[ArrayLayout, int, Span, np.ndarray]]) -> Field | None:
    """The :class:`Field` of ``windows``, each ``(layout, the item's offset in its pack's
    array, span of the item, slot)``; None where a slot does not fit its window (the
    general path says why) or the layouts differ in their time axis."""
    axis = windows[0][0].time_axis
    fits: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    srcs: dict[tuple[str, int], tuple[int, ArrayLayout, int]] = {}
    rows: list[tuple[int, int, int, int, int]] = []
    pads: list[tuple[int, int]] = []
    slots = []
    for d, (layout, o, span, slot) in enumerate(windows):
        fit = fits.get(layout.path)
        if fit is None:
            if layout.time_axis != axis:
                return None
            fit = fits[layout.path] = (layout.dtype, _across(layout))
        n = span.stop - span.start
        if slot.dtype != fit[0] or slot.shape[axis] != n + span.pad:
            return None
        if slot.shape[:axis] + slot.shape[axis + 1 :] != fit[1]:
            return None
        slots.append(slot)
        here, stop, width = o + span.start, o + span.stop, layout.shard
        while here < stop:  # an item may end in the next shard
            s = here // width
            take = min(stop, (s + 1) * width) - here
            src = srcs.get((layout.path, s))
            if src is None:
                src = srcs[(layout.path, s)] = (len(srcs), layout, s)
            rows.append((d, src[0], here - s * width, take, here - o - span.start))
            here += take
        if span.pad:
            pads.append((d, n))
    return Field(slots, srcs, rows, pads, axis)


def _across(layout: ArrayLayout) -> tuple[int, ...]:
    """The array's shape but its time axis."""
    return tuple(layout.shape[: layout.time_axis]) + tuple(layout.shape[layout.time_axis + 1 :])


def _whole(layout: ArrayLayout, s: int) -> Span:
    """Shard ``s`` whole (what its blocks' check covers once per process)."""
    return Span(s * layout.shard, min((s + 1) * layout.shard, layout.length))
