"""Which of a source's items a conversion takes: ``--include`` / ``--exclude`` patterns.

A file as it comes may hold groups that are not recordings (a ``meta`` group whose
arrays clash with the recordings' dtypes), or recordings known to be broken.  Patterns
are shell-style (``fnmatch``: ``*``, ``?``, ``[ab]``; ``*`` also crosses ``/``), matched
against an item's group path in its file (``spk1/utt3``) and against its name in the
store (``<file stem>/spk1/utt3`` when converted from several files).
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

from zstore.convert._source import SourceItem
from zstore.errors import SourceError


def _matches(it: SourceItem, patterns: Sequence[str]) -> bool:
    return any(fnmatchcase(it.group, p) or fnmatchcase(it.name, p) for p in patterns)


def select(
    items: list[SourceItem],
    include: Sequence[str] | None,
    exclude: Sequence[str] | None,
    where: str,
) -> tuple[list[SourceItem], list[str]]:
    """The items ``include`` names (all when None) less those ``exclude`` names, and a
    line for the report on those left out."""
    if not include and not exclude:
        return items, []
    kept = [
        it
        for it in items
        if (not include or _matches(it, include)) and not (exclude and _matches(it, exclude))
    ]
    if not kept:
        shown = ", ".join(f"'{it.name}'" for it in items[:5])
        raise SourceError(
            f"{where}: no item is left by --include {list(include or [])} / --exclude "
            f"{list(exclude or [])} (items: {shown}{' ...' if len(items) > 5 else ''})"
        )
    taken = {id(it) for it in kept}
    gone = [it.name for it in items if id(it) not in taken]
    if not gone:
        return kept, []
    first = ", ".join(gone[:3]) + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
    return kept, [f"{len(gone)} item(s) ({first}): left out by --include/--exclude"]
