"""Window starts drawn from (seed, epoch, index) alone, and the short-item policy.

The draw uses splitmix64, a fixed integer hash, so a start depends on nothing but
its three inputs: not on worker count, rank, call order, or the numpy version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zstore.errors import ConfigError, ShortItemError

SHORT_POLICIES = ("pad", "skip", "error")
_MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def draw_start(seed: int, epoch: int, index: int, choices: int, j: int = 0) -> int:
    """A start in ``range(choices)`` from ``(seed, epoch, index)`` alone (``j``: which of
    an item's windows in the epoch; the first is the same as with one window per item)."""
    if choices <= 1:
        return 0
    h = splitmix64(splitmix64(splitmix64(seed & _MASK) ^ (epoch & _MASK)) ^ (index & _MASK))
    if j:
        h = splitmix64(h ^ (j & _MASK))
    return h % choices


@dataclass(frozen=True)
class Window:
    """Item ``item`` at ``[start, start + take)`` on the coarsest grid, then ``pad`` frames."""

    item: int
    start: int
    take: int
    pad: int


def usable_items(
    lengths: np.ndarray,
    window: int | None,
    short: str,
    names: Sequence[str],
    leave_out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(indices of the items the dataset serves, indices of items shorter than the window);
    the items of ``leave_out`` are neither (left out for another reason)."""
    if short not in SHORT_POLICIES:
        raise ConfigError(f"short must be one of {SHORT_POLICIES}, got {short!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    every = np.arange(len(lengths), dtype=np.int64)
    keep = np.ones(len(lengths), dtype=bool)
    if leave_out is not None:
        keep[leave_out] = False
    if window is None:
        return every[keep], every[:0]
    short_items = np.flatnonzero((lengths < window) & keep)
    if short == "error" and len(short_items):
        shown = ", ".join(f"{names[i]} ({lengths[i]} < {window})" for i in short_items[:10])
        more = f" and {len(short_items) - 10} more" if len(short_items) > 10 else ""
        raise ShortItemError(
            f"{len(short_items)} item(s) are shorter than the window: "
            f"{shown}{more}; use short='pad' or short='skip', or a shorter "
            "window"
        )
    if short == "skip":
        return np.flatnonzero((lengths >= window) & keep), short_items
    return every[keep], short_items


def window_for(
    item: int, length: int, window: int | None, seed: int, epoch: int, j: int = 0
) -> Window:
    """Window ``j`` of ``item`` for this (seed, epoch)."""
    if window is None:
        return Window(item, 0, length, 0)
    if length >= window:
        return Window(item, draw_start(seed, epoch, item, length - window + 1, j), window, 0)
    return Window(item, 0, length, window - length)
