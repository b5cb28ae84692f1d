"""A stated precision for float arrays, and what the values of an array are.

``zstore convert --precision wav=100dB`` (or ``wav=16bits``) rounds each float value to
the nearest value with that many explicit mantissa bits (ties to even, as IEEE 754
rounds), before the store's usual codecs: the zero low bits then compress, and the store
stays core Zarr v3 that any reader opens.  Rounding to ``N`` bits moves a value by at
most half a unit in its ``N``-th bit, ``|x| * 2**-(N+1)``, so the signal-to-noise ratio
is at least ``20*log10(2**(N+1))`` ~ ``6.02*(N+1)`` dB whatever the signal: a target in
dB becomes the fewest bits that guarantee it.  Non-finite values, and the few finite ones
that rounding would carry to infinity, are kept as they are.

Pure: numpy only, no I/O.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from zstore.errors import SourceError

#: the array attribute that names an array's precision (absent: lossless)
PRECISION_ATTR = "zstore_precision"
_DB_PER_BIT = 20 * math.log10(2)
_UINT: dict[int, type[np.unsignedinteger[Any]]] = {2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True)
class Precision:
    """An array's stated precision: ``bits`` explicit mantissa bits are kept.  With the
    energies of the source and of the rounding error over the items converted so far,
    from which the measured SNR follows."""

    bits: int
    #: what the user asked for: ``"100dB"`` or ``"16bits"``
    stated: str
    signal: float = 0.0
    noise: float = 0.0

    @property
    def snr_db(self) -> float | None:
        """The SNR measured on the converted items (None: nothing measured; inf: no
        value moved)."""
        return snr_db(self.signal, self.noise)

    @property
    def guaranteed_db(self) -> float:
        """The SNR the rounding guarantees, whatever the signal."""
        return _DB_PER_BIT * (self.bits + 1)

    def summary(self) -> str:
        """``"16 mantissa bits (stated 100dB, >= 102 dB guaranteed, measured SNR
        109.8 dB)"``: what ``zstore info`` and the converter's report say of it."""
        snr = self.snr_db
        measured = (
            "SNR not measured"
            if snr is None
            else "no value moved by it"
            if math.isinf(snr)
            else f"measured SNR {snr:.1f} dB"
        )
        return (
            f"{self.bits} mantissa bits (stated {self.stated}, >= {self.guaranteed_db:.0f} dB "
            f"guaranteed, {measured})"
        )

    def measured(self, signal: float, noise: float) -> Precision:
        """This precision with more converted data's energies added."""
        return replace(self, signal=self.signal + signal, noise=self.noise + noise)

    def header(self) -> dict[str, Any]:
        """The manifest's record (JSON)."""
        snr = self.snr_db
        return {
            "mantissa_bits": self.bits,
            "stated": self.stated,
            "rounding": "nearest-even",
            "guaranteed_snr_db": round(self.guaranteed_db, 1),
            "snr_db": None if snr is None or math.isinf(snr) else round(snr, 2),
            "signal_energy": self.signal,
            "noise_energy": self.noise,
        }

    def attribute(self) -> dict[str, Any]:
        """The array attribute (:data:`PRECISION_ATTR`) every item's array carries."""
        return {"mantissa_bits": self.bits, "stated": self.stated, "rounding": "nearest-even"}

    @classmethod
    def from_header(cls, data: dict[str, Any]) -> Precision:
        return cls(
            int(data["mantissa_bits"]),
            str(data.get("stated", f"{data['mantissa_bits']}bits")),
            float(data.get("signal_energy") or 0.0),
            float(data.get("noise_energy") or 0.0),
        )


def snr_db(signal: float, noise: float) -> float | None:
    """The SNR in dB of energies ``signal`` and ``noise`` (None: no signal; inf: no
    noise)."""
    if signal <= 0:
        return None
    if noise <= 0:
        return math.inf
    return 10 * math.log10(signal / noise)


def bits_for_snr(db: float) -> int:
    """The fewest mantissa bits whose rounding guarantees ``db`` dB SNR."""
    return max(1, math.ceil(db / _DB_PER_BIT - 1e-9) - 1)


def parse_precision(name: str, value: Any) -> Precision:
    """``16``, ``"16bits"`` or ``"100dB"`` for array ``name``: its :class:`Precision`."""
    text = str(value).strip()
    if isinstance(value, bool):
        text = "?"
    elif isinstance(value, int):
        text = f"{value}bits"
    bits_match = re.fullmatch(r"(\d+)\s*(bits?|b)", text, re.IGNORECASE)
    db_match = re.fullmatch(r"(\d+(?:\.\d*)?)\s*db", text, re.IGNORECASE)
    if bits_match and int(bits_match.group(1)) >= 1:
        return Precision(int(bits_match.group(1)), f"{int(bits_match.group(1))}bits")
    if db_match and float(db_match.group(1)) > 0:
        db = float(db_match.group(1))
        return Precision(bits_for_snr(db), f"{db:g}dB")
    raise SourceError(
        f"--precision {name}={value}: give mantissa bits to keep (e.g. {name}=16bits) or a "
        f"signal-to-noise ratio to guarantee (e.g. {name}=100dB); leave it out to store "
        f"'{name}' lossless"
    )


def effective_bits(precision: Precision, dtype: np.dtype[Any]) -> int | None:
    """Mantissa bits to keep for values of ``dtype`` (None: every bit, no rounding)."""
    if dtype.kind != "f" or dtype.itemsize not in _UINT:
        return None
    return None if precision.bits >= np.finfo(dtype).nmant else precision.bits


def round_mantissa(x: np.ndarray, bits: int) -> np.ndarray:
    """``x`` (float16/32/64) rounded to ``bits`` explicit mantissa bits, to nearest,
    ties to even: a new array.  Non-finite values, and finite ones that would round to
    infinity, keep their value."""
    x = np.asarray(x)
    drop = np.finfo(x.dtype).nmant - bits
    if drop <= 0:
        return x.copy()
    uint = _UINT[x.dtype.itemsize]
    raw = np.ascontiguousarray(x).view(uint)
    out = (raw >> uint(drop)) & uint(1)
    out += uint((1 << (drop - 1)) - 1)
    out += raw
    out &= ~uint((1 << drop) - 1)
    rounded = out.view(x.dtype)
    keep = ~np.isfinite(rounded)
    if keep.any():
        rounded[keep] = x[keep]
    return rounded


def rounding_bound(x: np.ndarray, bits: int) -> np.ndarray:
    """Per value, the most that rounding ``x`` to ``bits`` mantissa bits may move it
    (float64): half a unit in the last kept place (subnormals: of their fixed scale)."""
    info = np.finfo(x.dtype)
    _, exponent = np.frexp(np.abs(x).astype(np.float64))
    place = np.maximum(exponent.astype(np.int64) - 1, info.minexp) - bits - 1
    return np.ldexp(1.0, place)


def within_rounding(stored: np.ndarray, source: np.ndarray, bits: int) -> int:
    """How many values of ``stored`` are not ``source`` rounded to ``bits`` bits, within
    :func:`rounding_bound` (non-finite values must be equal)."""
    src = np.asarray(source)
    got = np.asarray(stored)
    if got.shape != src.shape:
        return max(got.size, src.size)
    finite = np.isfinite(src)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(got.astype(np.float64) - src.astype(np.float64))
    bad = finite & ~(diff <= rounding_bound(src, bits))
    same_special = (np.isnan(src) & np.isnan(got)) | (src == got)
    return int(np.count_nonzero(bad) + np.count_nonzero(~finite & ~same_special))


def energies(source: np.ndarray, rounded: np.ndarray) -> tuple[float, float]:
    """The energies of ``source`` and of ``rounded - source`` over finite values.

    The difference is exact in the arrays' own dtype (the two are within a factor of two
    of each other), and each block of :data:`_BLOCK` values is summed by BLAS in that
    dtype, the blocks in float64: a third of the time of converting to float64 first."""
    src = np.ascontiguousarray(source).ravel()
    got = np.ascontiguousarray(rounded).ravel()
    signal = noise = 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        for i in range(0, src.size, _BLOCK):
            x = src[i : i + _BLOCK]
            e = got[i : i + _BLOCK] - x
            signal += float(np.dot(x, x))
            noise += float(np.dot(e, e))
    if math.isfinite(signal) and math.isfinite(noise):
        return signal, noise
    finite = np.isfinite(src)  # NaN or infinity among the values: leave them out
    x, e = src[finite].astype(np.float64), got[finite].astype(np.float64) - src[finite]
    return float(np.dot(x, x)), float(np.dot(e, e))


_BLOCK = 1 << 16


#: what a float array's values are: PCM samples of 16 bits (``k / 32768``), of 24 bits
#: (``k / 2**23``), whole numbers (labels, counts), or true float values
VALUE_KINDS = ("int16", "int24", "whole", "float")


#: values of an array :func:`value_kind` checks: all of a smaller array, else this many
#: spread evenly over it (checking all of a 13 MB item cost 60% of encoding it)
KIND_SAMPLE = 1 << 18


def value_kind(x: np.ndarray) -> str:
    """:data:`VALUE_KINDS` entry for a float array (``"float"`` as soon as a value is
    none of the others): checked on its first values, then on every value of an array
    of up to :data:`KIND_SAMPLE` values, or that many spread evenly over a larger one."""
    flat = np.asarray(x).ravel()
    if flat.dtype.kind != "f" or flat.dtype.itemsize < 4:
        return "float"
    if flat.size > KIND_SAMPLE:
        flat = flat[:: -(-flat.size // KIND_SAMPLE)]
    for kind, scale, top in (
        ("int16", 2.0**15, 2.0**15 - 1),
        ("int24", 2.0**23, 2.0**23 - 1),
        ("whole", 1.0, math.inf),
    ):
        if all(_scaled_whole(part, scale, top) for part in (flat[:4096], flat)):
            return kind
    return "float"


def _scaled_whole(x: np.ndarray, scale: float, top: float) -> bool:
    """Whether every ``x * scale`` is a whole number in ``[-scale, top]`` (any size when
    ``top`` is infinite)."""
    if not x.size:
        return True
    y = x * x.dtype.type(scale) if scale != 1.0 else x
    if not np.array_equal(y, np.rint(y)):
        return False
    return math.isinf(top) or bool(y.min() >= -scale and y.max() <= top)


def wider_kind(a: str | None, b: str | None) -> str | None:
    """The kind that holds the values of both (None: not known)."""
    if a is None or b is None:
        return a or b
    if a == b:
        return a
    return "int24" if {a, b} == {"int16", "int24"} else "float"
