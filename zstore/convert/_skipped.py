"""What a conversion leaves out of its sources, said once per kind.

The scan names each thing it leaves out, ``"<path>: <why>"`` (a string dataset, a
dangling link, ...).  A corpus keeps the same thing in every group (a transcript as a
string dataset in each utterance's group), so one line per path made two warnings and
two report lines per item, and a manifest root header that grew with the corpus and
is read by every process that opens the store.  :func:`summarize` makes one line of
every dataset name left out for the same reason, with how many groups and the first
few, and keeps the list to :data:`MAX_LINES`.
"""

from __future__ import annotations

import re

#: lines of what was left out that a conversion keeps (in its report and the manifest)
MAX_LINES = 100
#: groups named in a line that stands for several
SHOWN = 3
#: lines of it said as warnings (the report and ``zstore info --json`` have the rest)
MAX_WARNINGS = 10


def summarize(skipped: list[str]) -> list[str]:
    """``skipped`` with the entries that leave out a dataset of the same name for the
    same reason in several groups made one line (``"text: non-numeric dtype object, in
    300 groups (rec_000, rec_001, rec_002 and 297 more)"``), in the order each kind was
    first met; the others as they are; at most MAX_LINES lines, the last counting the
    rest."""
    kinds: dict[tuple[str, str], list[str]] = {}
    first: dict[tuple[str, str], str] = {}
    for entry in skipped:
        path, sep, why = entry.partition(": ")
        where, _, name = path.rpartition("/")
        kind = (name, why) if sep else (entry, "")
        kinds.setdefault(kind, []).append(where)
        first.setdefault(kind, entry)
    lines = []
    for (name, why), groups in kinds.items():
        if len(groups) == 1:
            lines.append(first[(name, why)])
            continue
        shown = ", ".join(g or "/" for g in groups[:SHOWN])
        more = f" and {len(groups) - SHOWN:,} more" if len(groups) > SHOWN else ""
        lines.append(f"{name}: {why}, in {len(groups):,} groups ({shown}{more})")
    return _capped(lines, 0)


_MORE = re.compile(r"\.\.\. and ([\d,]+) more left out")


def extend(kept: list[str], new: list[str]) -> list[str]:
    """A store's list of what was left out (``kept``, the manifest's) with an append's
    ``new`` lines: at most MAX_LINES in all however many appends there are, the last
    counting the rest (a store appended to daily would otherwise grow its root header,
    which every process reads, by up to MAX_LINES lines a day)."""
    more = 0
    lines: list[str] = []
    for part in (kept, new):
        if part and (m := _MORE.fullmatch(part[-1])):
            more += int(m.group(1).replace(",", ""))
            part = part[:-1]
        lines += part
    return _capped(lines, more)


def _capped(lines: list[str], more: int) -> list[str]:
    """``lines`` and ``more`` lines left out of them, in at most MAX_LINES lines: the
    last counts what is not shown."""
    room = MAX_LINES - 1 if more or len(lines) > MAX_LINES else MAX_LINES
    more += max(0, len(lines) - room)
    return lines[:room] + ([f"... and {more:,} more left out"] if more else [])
