"""Byte counts and durations for people: parse ``"64GB"``, ``"500MiB"`` and ``"7d"``,
print ``1.5 KiB``.

A shared leaf: every layer may import it; it imports only :mod:`zstore.errors`.
"""

from __future__ import annotations

import math
import re

from zstore.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, *, name: str = "size") -> int:
    """Parse a byte count: ``1000``, ``"64GB"``, ``"500MiB"``, ``"1.5 G"``.

    >>> parse_size("64GB"), parse_size("500MiB"), parse_size(0)
    (64000000000, 524288000, 0)
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{name}: expected a byte count such as 1000000 or '64GB', got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ConfigError(
                f"{name}: {value!r} is not a byte count; write e.g. 1000000 or '64GB'"
            )
        if value < 0:
            raise ConfigError(
                f"{name}: a byte count cannot be negative ({value!r}); use 0 to turn the tier off"
            )
        return int(value)
    if value.strip().startswith("-"):
        raise ConfigError(
            f"{name}: a byte count cannot be negative ({value!r}); use 0 to turn the tier off"
        )
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ConfigError(
            f"{name}: cannot read {value!r} as a size; write e.g. 1000000, '64GB' or '500MiB'"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """Render a byte count for people: ``format_size(1536) == '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(value: int | float | str, *, name: str = "duration") -> float:
    """Seconds from ``"7d"``, ``"12h"``, ``"30m"``, ``"45s"``, ``"1w"`` or a number of
    seconds; a clear error naming ``name`` otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        m = _SIZE_RE.match(str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _SECONDS:
            raise ConfigError(
                f"{name} {value!r}: write a number of seconds or one with a unit "
                "(s, m, h, d, w), e.g. 7d or 12h"
            )
        seconds = float(m.group(1)) * _SECONDS[unit]
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"{name} {value!r}: must be 0 or more")
    return seconds
