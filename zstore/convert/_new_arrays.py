"""Arrays an append brings that the store lacks.

A corpus grows features: later files carry a speaker embedding, a label, a new frame
track.  An append adds such arrays to the store; the items before it lack them, as
items of a store converted from groups of unlike arrays do (the manifest's presence
rows), and a reader asks for them with ``fields=`` and ``missing=``.  What the store has
stays as it is: its arrays' rates, time axes, dtypes and dimensions bind the new items.

A new array is planned as a conversion plans one: a rate given with ``--rate`` (only
for arrays the store lacks: the store's own are stated, not changed), or inferred from
a whole-number length ratio to a rated array, else stored whole; its time axis from
``--time-axis NAME=A``, else the conversion's one axis for all where it gave one, else
the last; a ``--precision`` stated for it rounds it, a ``--dtype`` casts it (the
manifest keeps the cast, as a conversion's, for the appends after).  A name given that
neither the store nor the new items have is refused, as a conversion refuses it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from zstore.convert._source import SourcePlan
from zstore.convert._values import with_precision
from zstore.convert.pipeline import dtypes_of, with_dtypes
from zstore.errors import SourceError
from zstore.format import ArrayInfo, Manifest, parse_precision


def planned_axes(
    manifest: Manifest, time_axis: int | Mapping[str, int] | None
) -> tuple[int | dict[str, int], int]:
    """The time axis option the append's scan takes, and the axis of the arrays a dict
    of them does not name: one axis for all where the append gave one (checked against
    the store's arrays first); else the store's arrays' own axes with those given for
    new arrays, the others on the conversion's one axis where it gave one (the store's
    arrays were made with it), else the last."""
    if isinstance(time_axis, int):
        return time_axis, time_axis
    made = (manifest.extra.get("fingerprint") or {}).get("options", {}).get("time_axis")
    others = made if isinstance(made, int) and not isinstance(made, bool) else -1
    axes = {n: a.time_axis for n, a in manifest.arrays.items() if a.time_axis is not None}
    for name, axis in (time_axis or {}).items():
        if name not in manifest.arrays:
            axes[name] = axis
    return axes, others


def planned_rates(
    manifest: Manifest, rates: Mapping[str, float | None] | None
) -> dict[str, float | None]:
    """The rates the append's scan takes: the store's own (None: stored whole), and
    those given for arrays the store lacks."""
    out: dict[str, float | None] = {n: a.rate for n, a in manifest.arrays.items()}
    for name, rate in (rates or {}).items():
        if name not in manifest.arrays:
            out[name] = rate
    return out


def with_new_arrays(
    manifest: Manifest,
    source: SourcePlan,
    dst: str,
    given: Collection[str],
    precision: Mapping[str, int | str] | None,
) -> dict[str, ArrayInfo]:
    """The store's arrays, then the new items' arrays it lacks (as planned, with their
    dtype and any stated precision).  ``given``: the names the append's options gave
    (``--rate``, ``--time-axis``, ``--precision``), refused where neither the store nor
    the new items have them."""
    unknown = sorted(n for n in given if n not in manifest.arrays and n not in source.arrays)
    if unknown:
        raise SourceError(
            f"{dst}: options were given for array(s) {unknown}, but neither the store "
            f"(arrays: {sorted(manifest.arrays)}) nor the new items "
            f"(arrays: {sorted(source.arrays)}) have them; leave them out"
        )
    new = [n for n in source.arrays if n not in manifest.arrays]
    out = dict(manifest.arrays)
    if not new:
        return out
    planned = with_dtypes(source)
    stated = {
        n: parse_precision(n, v) for n, v in (precision or {}).items() if n not in manifest.arrays
    }
    planned = with_precision({n: planned[n] for n in new}, dtypes_of(source), stated, dst)
    for name in new:
        out[name] = planned[name]
    return out
