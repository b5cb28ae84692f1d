"""What the converter learns of the values it writes, and the stated precision applied
to them: per array, the source and stored bytes, what a float array's values are
(:data:`zstore.format.precision.VALUE_KINDS`) and the energies of the rounding error.
Tallied per batch in the workers, summed by the converter into its report and the
manifest."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field

import numpy as np

from zstore.convert._casts import cast_text, cast_values
from zstore.convert._fields import source_dataset
from zstore.convert._source import SourceItem, open_source
from zstore.errors import SourceError, some_names
from zstore.format import (
    ArrayInfo,
    Precision,
    effective_bits,
    encode_array,
    energies,
    geometry,
    round_mantissa,
    snr_db,
    value_kind,
    wider_kind,
)


@dataclass
class ArrayTally:
    """One array's figures over the items written."""

    source_bytes: int = 0
    stored_bytes: int = 0
    kind: str | None = None  # float arrays only
    signal: float = 0.0
    noise: float = 0.0
    nonfinite: int = 0  # NaN and infinite values
    nonfinite_items: list[str] = field(default_factory=list)  # the items holding them

    def add(self, other: ArrayTally) -> None:
        self.source_bytes += other.source_bytes
        self.stored_bytes += other.stored_bytes
        self.kind = wider_kind(self.kind, other.kind)
        self.signal += other.signal
        self.noise += other.noise
        self.nonfinite += other.nonfinite
        self.nonfinite_items += other.nonfinite_items

    def count_nonfinite(self, item: str, data: np.ndarray) -> None:
        """Tally the NaN and infinite values of item ``item``'s array ``data`` (a float
        or complex array, or a block of one; ~0.7 ms for 15 MB of float32)."""
        if data.dtype.kind not in "fc" or not data.size:
            return
        finite = np.isfinite(data)
        if not finite.all():
            self.nonfinite += int(data.size - np.count_nonzero(finite))
            if not self.nonfinite_items or self.nonfinite_items[-1] != item:
                self.nonfinite_items.append(item)

    def nonfinite_text(self) -> str | None:
        """What the report and the warning say of the NaN and infinite values."""
        if not self.nonfinite:
            return None
        names = sorted(set(self.nonfinite_items))
        return (
            f"{self.nonfinite} NaN or infinite value(s) in {len(names)} item(s) "
            f"({some_names(names, at_most=3)}), "
            "stored as they are: a window over them gives training NaN or inf"
        )


@dataclass
class Tally:
    """What a batch of items (or a whole conversion) wrote."""

    items: int = 0
    stored_bytes: int = 0
    arrays: dict[str, ArrayTally] = field(default_factory=dict)
    #: each item's checksum of its values (zstore.convert._copies), by name
    digests: dict[str, str] = field(default_factory=dict)

    def add(self, other: Tally) -> Tally:
        self.items += other.items
        self.stored_bytes += other.stored_bytes
        self.digests.update(other.digests)
        for name, a in other.arrays.items():
            self.arrays.setdefault(name, ArrayTally()).add(a)
        return self

    def array(self, name: str) -> ArrayTally:
        return self.arrays.setdefault(name, ArrayTally())


def stored_values(info: ArrayInfo, data: np.ndarray, what: str = "an item") -> np.ndarray:
    """``data`` as the store holds it: cast to the array's dtype (``--dtype``; ``what``
    names the data if its values do not fit) and rounded to its stated precision
    (itself when neither applies)."""
    data = cast_values(info.dtype, data, what)
    bits = None if info.precision is None else effective_bits(info.precision, data.dtype)
    return data if bits is None else round_mantissa(data, bits)


def prepared(
    info: ArrayInfo,
    data: np.ndarray,
    tally: ArrayTally,
    item: str | None = None,
    cast: np.ndarray | None = None,
) -> np.ndarray:
    """:func:`stored_values`, with what the values are and what rounding cost tallied
    (and, given the ``item`` they are all of, their NaN and infinite values).  ``cast``:
    ``data`` already cast to the array's dtype by the caller (``cast_values``), not cast
    again."""
    tally.source_bytes += data.nbytes
    if item is not None:
        tally.count_nonfinite(item, data)
    if data.dtype.kind != "f":
        return data
    # Once one item is true float, the array is; an item of zeros says nothing (short
    # activity labels often are: they would read as int16 samples, then as "float").
    if tally.kind != "float" and data.any():
        tally.kind = wider_kind(tally.kind, value_kind(data))
    what = "an item" if item is None else f"item '{item}'"
    rounded = stored_values(info, data if cast is None else cast, what)
    if info.precision is not None:
        signal, noise = energies(data, rounded)
        tally.signal += signal
        tally.noise += noise
    return rounded


def with_tally(arrays: dict[str, ArrayInfo], tally: Tally) -> dict[str, ArrayInfo]:
    """The arrays' manifest entries with what this conversion measured added: the
    values' kind and the precision's energies."""
    out = dict(arrays)
    for name, t in tally.arrays.items():
        info = out.get(name)
        if info is None:
            continue
        precision = info.precision
        if precision is not None:
            precision = precision.measured(t.signal, t.noise)
        out[name] = dataclasses.replace(
            info, precision=precision, values=wider_kind(info.values, t.kind)
        )
    return out


#: mantissa bits the report estimates for a true-float array stored lossless
SUGGESTED_BITS = (16, 12)
#: values of a sample to estimate on (~4 MB of float32)
SAMPLE_VALUES = 1 << 20
#: the report gives the stored/source ratio of arrays of at least this many source
#: bytes (a scalar float label per item: its zarr.json alone is ~20x its 4 bytes)
RATIO_BYTES = 1 << 16
#: a precision is suggested for arrays of at least this many source bytes (a corpus's
#: embeddings of a few values each gain nothing worth a lossy store)
SUGGEST_BYTES = 1 << 20


def estimate(
    data: np.ndarray, info: ArrayInfo, chunk_seconds: float, codec: str
) -> list[tuple[int, float, float]]:
    """For a sample of a true-float array: per :data:`SUGGESTED_BITS`, the bits, the
    stored/source ratio and the SNR (dB) that precision would give with this codec."""
    axis = info.time_axis
    if axis is not None and data.ndim:
        steps = max(1, SAMPLE_VALUES // max(1, data.size // max(1, data.shape[axis])))
        data = np.take(data, np.arange(min(steps, data.shape[axis])), axis=axis)
    out = []
    for bits in SUGGESTED_BITS:
        if bits >= np.finfo(data.dtype).nmant:
            continue
        rounded = round_mantissa(data, bits)
        chunks, shards = geometry(
            data.shape, info.rate, info.time_axis, chunk_seconds, data.dtype.itemsize
        )
        stored = sum(
            len(v)
            for v in encode_array(
                rounded, chunks, shards, codec, -1 if axis is None else axis
            ).values()
        )
        snr = snr_db(*energies(data, rounded)) or 0.0
        out.append((bits, stored / max(1, data.nbytes), snr))
    return out


def describe(
    name: str,
    info: ArrayInfo,
    tally: ArrayTally,
    estimates: list[tuple[int, float, float]],
    cast_from: str | None = None,
) -> str | None:
    """The report's line on a float array's values and how they were stored (cast from
    the dtype(s) ``cast_from`` names)."""
    if tally.kind is None:
        return None
    ratio = tally.stored_bytes / tally.source_bytes if tally.source_bytes else 0.0
    dtype = info.dtype or "float"
    what = {
        "int16": f"{dtype} holding only int16 sample values (x / 32768)",
        "int24": f"{dtype} holding only int24 sample values (x / 2**23)",
        "whole": f"{dtype} holding only whole numbers",
        "float": f"true {dtype} values",
    }[tally.kind]
    if cast_from:
        what += f" (cast from {cast_from}, to nearest)"
    stored = "stored" if cast_from else "stored lossless"
    if info.precision is not None:
        return f"{what}, kept to {info.precision.summary()}: {ratio:.2f}x of the source"
    if tally.source_bytes < RATIO_BYTES:  # a few labels: their metadata outweighs them
        return f"{what}, {stored}"
    line = f"{what}, {stored} at {ratio:.2f}x of the source"
    useful = [(bits, r, snr) for bits, r, snr in estimates if math.isfinite(snr) and r < ratio]
    if useful:
        line += "; " + ", ".join(
            f"--precision {name}={bits}bits would give ~{r:.2f}x at {snr:.0f} dB"
            for bits, r, snr in useful
        )
        line += " (on a sample)"
    return line


def with_precision(
    arrays: dict[str, ArrayInfo],
    dtypes: dict[str, set[str]],
    stated: dict[str, Precision],
    where: str,
) -> dict[str, ArrayInfo]:
    """The planned arrays with the stated precisions: each must name a float array
    (integer arrays, and arrays not named, keep their exact values)."""
    out = dict(arrays)
    for name, precision in stated.items():
        if name not in arrays:
            raise SourceError(
                f"{where}: --precision {name}=...: no array is named '{name}' "
                f"(arrays: {', '.join(sorted(arrays))})"
            )
        kinds = sorted(np.dtype(d).name for d in dtypes.get(name, ()))
        if not kinds or any(np.dtype(d).kind != "f" for d in kinds):
            raise SourceError(
                f"{where}: --precision {name}={precision.stated}: '{name}' is "
                f"{'/'.join(kinds) or 'not a numeric array'}; a precision applies to float "
                "arrays only (integer arrays keep their exact values): leave it out"
            )
        out[name] = dataclasses.replace(arrays[name], precision=precision)
    return out


def sample(item: SourceItem, name: str, time_axis: int | None) -> np.ndarray:
    """The first :data:`SAMPLE_VALUES` or so values of an item's array, along time."""
    with open_source(item.source) as f:
        ds = source_dataset(f[item.group], item.fields, name)
        if time_axis is None or not ds.ndim:
            return np.asarray(ds[()])
        per_step = max(1, ds.size // max(1, ds.shape[time_axis]))
        index = [slice(None)] * ds.ndim
        index[time_axis] = slice(0, max(1, SAMPLE_VALUES // per_step))
        return np.asarray(ds[tuple(index)])


def value_lines(
    arrays: dict[str, ArrayInfo],
    tally: Tally,
    items: list[SourceItem],
    chunk_seconds: float,
    codec: str,
) -> dict[str, str]:
    """The report's lines on the float arrays written: what their values are, how they
    were stored, and for true float values stored lossless what a precision would give."""
    lines = {}
    for name, t in tally.arrays.items():
        info = arrays.get(name)
        nonfinite = t.nonfinite_text()
        if info is None or t.kind is None:
            if info is not None and nonfinite:  # complex values
                lines[name] = nonfinite
            continue
        estimates: list[tuple[int, float, float]] = []
        if t.kind == "float" and info.precision is None and t.source_bytes >= SUGGEST_BYTES:
            first = next((it for it in items if name in it.shapes), None)
            if first is not None:
                data = sample(first, name, info.time_axis)
                estimates = estimate(data, info, chunk_seconds, codec)
        line = describe(name, info, t, estimates, cast_text(name, items))
        found = [x for x in (line, nonfinite) if x]
        if found:
            lines[name] = "\n    ".join(found)
    return lines


def warn_nonfinite(where: str, tally: Tally, stacklevel: int) -> None:
    """One warning per array written with NaN or infinite values (the report says it too):
    the converter stores them as they are, and training would read them."""
    for name, t in tally.arrays.items():
        text = t.nonfinite_text()
        if text:
            warnings.warn(f"{where}: '{name}' holds {text}", stacklevel=stacklevel + 1)
