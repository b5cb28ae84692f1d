"""Rates the converter infers: an array without ``--rate`` whose length along its time
axis is a whole-number ratio to a rated array's in items of different lengths gets the
rate that ratio implies; otherwise the report says why not (one item off the ratio,
another axis that fits, the rate it would have).

May import: zstore.format, zstore.convert._source (for ``SourceItem``, types only).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from zstore.format import ArrayInfo

if TYPE_CHECKING:
    from zstore.convert._source import SourceItem

#: the fewest values along time (in the longest item) that a rate is inferred from
MIN_STEPS = 8


def _implied_ratio(xs: list[int], rs: list[int]) -> tuple[str, int] | None:
    """('div', k) when x == r / k in every item (rounded down or up: an item shorter than
    one frame has none), ('mul', k) when x == r * k; only when the items show at least
    two different lengths: a ratio seen in items of one length (or in one item) proves
    nothing (a 10-value embedding in 3 s segments has a 'ratio' of 4,800 to 16 kHz
    audio).  A divided length must reach :data:`MIN_STEPS` in the longest item: a
    table of 1-2 rows per recording fits r / k, rounded, for some k in any few items.

    Items where both are 0 (zero-length recordings) fit any ratio and are left out.
    """
    pairs = [(x, r) for x, r in zip(xs, rs) if x or r]
    if len({r for _, r in pairs}) < 2:
        return None
    xs, rs = [p[0] for p in pairs], [p[1] for p in pairs]
    x0, r0 = max(pairs)  # the longest: a short item's rounding would skew k
    if x0 >= MIN_STEPS:
        k = max(1, round(r0 / x0))
        if all(r // k <= x <= -(-r // k) for x, r in zip(xs, rs)):
            return ("div", k)
    if all(r > 0 for r in rs) and xs[0] % rs[0] == 0:
        k = xs[0] // rs[0]
        if k >= 1 and all(x == r * k for x, r in zip(xs, rs)):
            return ("mul", k)
    return None


def inferred(
    n: str, items: list[SourceItem], arrays: dict[str, ArrayInfo], axis: int | None, ndim: int
) -> ArrayInfo:
    """Array ``n``'s rate from its length ratio to a given rate, or why it has none."""
    given = {r: info for r, info in arrays.items() if info.rate and not info.inferred}
    if ndim == 0 or axis is None or not given:
        return ArrayInfo(None, None, note="stored whole (no time axis)")
    with_both = {ref: [it for it in items if n in it.shapes and ref in it.shapes] for ref in given}
    for ref, info in given.items():
        both = with_both[ref]
        if not both:
            continue
        xs = [it.shapes[n][axis] for it in both]
        rs = [it.shapes[ref][info.time_axis] for it in both]  # type: ignore[index]
        found = _implied_ratio(xs, rs)
        if found:
            kind, k = found
            rate = info.rate / k if kind == "div" else info.rate * k  # type: ignore[operator]
            lengths = len({r for r in rs if r})
            return ArrayInfo(
                rate,
                axis,
                inferred=True,
                note=f"{_ratio_text(found, ref)} in {len(both)} items of {lengths} lengths",
            )
    ref, info = next(iter(given.items()))  # the reason is told against the first rated array
    both = with_both[ref]
    seen = len({it.shapes[ref][info.time_axis] for it in both})  # type: ignore[index]
    why = (
        f"never in the same item as '{ref}'"
        if not both
        else f"in {len(both)} item(s) of {seen} length(s)"
        if seen < 2
        else f"not a whole-number ratio to '{ref}' in every item"
    )
    guess = ""
    other = _other_axis(n, both, axis, ref, info) if both and seen >= 2 else None
    if other is not None:
        return ArrayInfo(
            None,
            None,
            note=f"stored whole: no time axis proven along its axis {axis} ({why}); along "
            f"axis {other[0]} it is {other[1]}: if that is its time axis, give "
            f"--time-axis {n}={other[0]}",
        )
    if both and both[0].shapes[n][axis] and seen < 2:
        ratio = both[0].shapes[ref][info.time_axis] / both[0].shapes[n][axis]  # type: ignore[index]
        guess = f" ({info.rate / ratio:g} if it is)"  # type: ignore[operator]
    most = _most_items_ratio(n, both, axis, ref, info) if seen >= 2 else None
    if most is not None:
        k, fit, misfits = most
        rate = info.rate / k  # type: ignore[operator]
        return ArrayInfo(
            None,
            None,
            note=f"stored whole: no time axis proven ({why}: 1/{k} of it in {fit} of "
            f"{len(both)} items, not in {misfits}); if it is a time array, give --rate "
            f"{n}={rate:g} and the conversion names the items where it does not fit",
        )
    return ArrayInfo(
        None,
        None,
        note=f"stored whole: no time axis proven ({why}); if it is a "
        f"time array, give --rate {n}=RATE{guess}",
    )


def _most_items_ratio(
    n: str, both: list[SourceItem], axis: int, ref: str, info: ArrayInfo
) -> tuple[int, int, str] | None:
    """The ratio k (``n``'s length is ``ref``'s / k) that most items of ``both`` show,
    when some do not: (k, how many fit, the first few that do not, with both lengths).
    One truncated or mislinked item stops the inference; this names it."""
    lengths = [(it.name, it.shapes[n][axis], it.shapes[ref][info.time_axis]) for it in both]  # type: ignore[index]
    ks = Counter(max(1, round(r / x)) for _, x, r in lengths if x >= MIN_STEPS)
    if not ks:
        return None
    k = ks.most_common(1)[0][0]
    bad = [(name, x, r) for name, x, r in lengths if not r // k <= x <= -(-r // k)]
    fit = len(lengths) - len(bad)
    if not bad or fit < 2 or fit <= len(bad):
        return None
    shown = ", ".join(f"'{name}' ({x} against {r})" for name, x, r in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return k, fit, shown + more


def _other_axis(
    n: str, both: list[SourceItem], axis: int, ref: str, info: ArrayInfo
) -> tuple[int, str] | None:
    """Another axis of ``n`` whose length has a whole-number ratio to ``ref``'s time
    axis in every item of ``both`` (features stored frames first), and that ratio."""
    rs = [it.shapes[ref][info.time_axis] for it in both]  # type: ignore[index]
    for other in range(len(both[0].shapes[n])):
        if other == axis:
            continue
        found = _implied_ratio([it.shapes[n][other] for it in both], rs)
        if found:
            return other, _ratio_text(found, ref)
    return None


def _ratio_text(found: tuple[str, int], ref: str) -> str:
    """A ratio :func:`_implied_ratio` found, as the report says it."""
    kind, k = found
    return f"{'1/' if kind == 'div' else ''}{k} of the length of '{ref}'"
