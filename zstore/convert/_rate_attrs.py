"""Rates the source states in attributes, checked against the rates a conversion uses.

HDF5 corpora often say each recording's sample rate in an attribute (``sr``,
``sample_rate``, ``fs``) of its group or of the audio dataset.  A corpus mixing 8 kHz
telephone and 16 kHz recordings, converted with ``--rate wav=16000``, would otherwise
give windows of the 8 kHz items that last twice as long as asked, with no error when
no other time array is there to contradict it.  So before anything is written:

- an attribute of a time array's dataset must be that array's rate (in Hz or kHz);
- an attribute of an item's group must be the rate of one of its time arrays, and so
  must a one-value dataset named like one (``fs``: MATLAB keeps ``rec.fs`` so).

Only objects the scan saw attributes on are looked at (~30 us each); sources on object
stores are not checked here.  May import: zstore.convert._source, zstore.format.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from zstore.convert._source import open_source
from zstore.errors import SourceError, some_names
from zstore.urls import is_url

if TYPE_CHECKING:
    from zstore.convert._source import SourceItem
    from zstore.format import ArrayInfo

#: attribute names that state a sample or frame rate, in samples per second
RATE_ATTRS = frozenset(
    {"sample_rate", "sampling_rate", "samplerate", "sample_rate_hz", "sr", "fs", "frame_rate"}
)
#: the mismatches the error describes in full
SHOWN = 3


def stated_rates(fid: Any, path: str) -> dict[str, float]:
    """The rate attributes (:data:`RATE_ATTRS`, in any case) of the object at ``path``
    with one number as their value (~30 us an object)."""
    oid = h5py.h5o.open(fid, path.encode("utf-8", "surrogateescape"))
    names: list[bytes] = []
    h5py.h5a.iterate(oid, names.append)  # names.append returns None: every name is seen
    out = {}
    for raw in names:
        name = raw.decode("utf-8", "replace")
        if name.lower() not in RATE_ATTRS:
            continue
        aid = h5py.h5a.open(oid, raw)
        if aid.get_type().get_class() not in _NUMBERS:
            continue
        if aid.get_space().get_simple_extent_npoints() != 1:
            continue
        value = np.empty(aid.shape, np.float64)
        aid.read(value, mtype=h5py.h5t.NATIVE_DOUBLE)
        if math.isfinite(float(value.reshape(-1)[0])):
            out[name] = float(value.reshape(-1)[0])
    return out


_NUMBERS = (h5py.h5t.INTEGER, h5py.h5t.FLOAT)


def _same(stated: float, rate: float) -> bool:
    """Whether an attribute's ``stated`` value is ``rate``: in Hz, or in kHz (``sr=16``,
    ``fs=44.1``, as some corpora keep it)."""
    return any(abs(v - rate) <= 1e-6 * max(abs(v), abs(rate)) for v in (stated, stated * 1000))


def check_rate_attrs(items: list[SourceItem], arrays: dict[str, ArrayInfo], path: str) -> None:
    """Raise :class:`SourceError` naming the items whose rate attributes contradict the
    rates of ``arrays`` (see the module)."""
    timed = {n: float(a.rate) for n, a in arrays.items() if a.rate is not None}
    if not timed:
        return
    wrong: list[tuple[str, str]] = []  # (item, what it says)
    by_file: dict[str, list[SourceItem]] = {}
    for it in items:  # a file is opened only for the items that may state a rate
        if not is_url(it.source) and _may_state(it, timed):
            by_file.setdefault(it.source, []).append(it)
    for source, batch in by_file.items():
        with open_source(source) as f:
            for it in batch:
                said = _item(f, it, timed)
                if said is not None:
                    wrong.append((it.name, said))
    if not wrong:
        return
    shown = "; ".join(f"'{name}': {said}" for name, said in wrong[:SHOWN])
    more = f"; and {len(wrong) - SHOWN} more" if len(wrong) > SHOWN else ""
    raise SourceError(
        f"{path}: {len(wrong)} item(s) state a rate (in an attribute or a dataset) that is "
        f"not the rate given or inferred for their arrays ({shown}{more}). Windows of them "
        "would last another time than asked. Check --rate; items recorded at another rate "
        "need a store of their own (--include/--exclude choose them: "
        f"{some_names([n for n, _ in wrong], at_most=5)})"
    )


def _may_state(it: SourceItem, timed: dict[str, float]) -> bool:
    """Whether item ``it`` has attributes where a rate may be stated (its group, its
    time arrays' datasets; unknown counts count as some), or a dataset named like one."""
    mine = [n for n in timed if n in it.shapes]
    if not mine:
        return False
    if any(n.lower() in RATE_ATTRS for n in it.shapes):
        return True
    counts = it.with_attrs
    return counts is None or any(counts.get(n) for n in ("", *mine))


def _item(f: h5py.File, it: SourceItem, timed: dict[str, float]) -> str | None:
    """What item ``it`` of the open file ``f`` states against the rates ``timed``, or
    None if nothing."""
    mine = {n: r for n, r in timed.items() if n in it.shapes}
    if not mine:
        return None
    counts = it.with_attrs
    for name in ("", *mine):
        if counts is not None and not counts.get(name):
            continue
        dataset = it.fields.get(name, (name, ""))[0] if name else ""
        if name and it.fields.get(name, ("", ""))[1]:
            continue  # a compound's field: the table's attributes are not its rate
        where = f"{it.group}/{dataset}".rstrip("/") if dataset else it.group
        try:
            stated = stated_rates(f.id, where)
        except (KeyError, OSError, RuntimeError):
            continue
        for attr, value in stated.items():
            if name and not _same(value, mine[name]):
                return f"its '{name}' has {attr}={value:g}, but '{name}' is at {mine[name]:g}/s"
            if not name and not any(_same(value, r) for r in mine.values()):
                return f"its group has {attr}={value:g}, {_none_at(mine)}"
    for name, shape in it.shapes.items():  # a rate kept as a dataset: MATLAB's rec.fs
        if name.lower() not in RATE_ATTRS or math.prod(shape) != 1 or name in it.fields:
            continue
        if it.dtypes[name].kind not in "iuf":
            continue
        try:
            value = float(np.asarray(f[it.group][name][()]).reshape(-1)[0])
        except (KeyError, OSError, RuntimeError):
            continue
        if math.isfinite(value) and not any(_same(value, r) for r in mine.values()):
            return f"its dataset '{name}' is {value:g}, {_none_at(mine)}"
    return None


def _none_at(mine: dict[str, float]) -> str:
    rates = ", ".join(f"{n}: {r:g}/s" for n, r in mine.items())
    return f"and no time array of it is at that rate ({rates})"
