"""``ram_format="auto"``: what the RAM tier holds, chosen from the data's size and the budget.

Measured (docs/benchmarks.md, "Beyond the RAM budget"): a warm decoded shard serves a
window at the copy limit, an encoded chunk costs its decode whether it comes from the
RAM tier or a page-cached SSD tier holding whole shards.  So decoded shards are as good
a use of RAM as encoded ones or better at every budget (0.94-1.04x the better of the
two in one process, ahead with 4 ranks), with admission keeping the resident share stable:
a window whose shard is resident is a copy, the others decode their chunks from the SSD
tier.  Only when no SSD tier can hold the store does the compressed form earn the RAM:
it keeps ~2x more of the store off the origin.

Where the store is read by ranges (a local disk, or no SSD tier to hold it whole; items
not packed), the decoded form is ``"chunks"``: decoded shards filled
chunk by chunk by the reads themselves (``zstore.read._chunk_shards``), so the first
epoch decodes nothing for the tier alone (docs/benchmarks.md, "The first epoch").  A
remote store fetched into the SSD tier whole keeps whole decoded shards, built behind
reads that wait on the origin anyway.  Below the decoded data's size, ``chunks`` read
the first epoch at 0.86-0.96x of no tier against 0.69-0.83x (budgets 0.5 and 0.33, 1
and 4 ranks), later epochs alike (docs/benchmarks-notes.md).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

from zstore.cache.files import write_json
from zstore.cache.options import ResolvedCache
from zstore.cache.ownership import make_dir
from zstore.units import format_size


@dataclass(frozen=True)
class FormatChoice:
    """What the RAM tier holds for one store, and why."""

    format: str  # "chunks", "decoded" or "encoded"
    reason: str
    decoded_bytes: int
    stored_bytes: int
    budget: int


def choose(
    config: ResolvedCache, decoded_bytes: int, stored_bytes: int, *, whole_shards: bool = True
) -> FormatChoice:
    """The RAM format for a store whose fields take ``decoded_bytes`` as decoded shards
    in the RAM tier (float int16 samples as int16: ``Sizes.ram_bytes``) and
    ``stored_bytes`` compressed, under ``config`` (``ram_format`` "auto" or explicit).
    ``whole_shards``: the reader reads whole shards: fetched whole into the SSD tier (a
    remote origin whose store the SSD tier holds), or gathered a batch at a time (short
    items packed together); else the windows' chunks by ranges."""
    budget = config.ram_bytes if config.ram_dir else 0
    sizes = (
        f"decoded {format_size(decoded_bytes)} in RAM, stored {format_size(stored_bytes)}, "
        f"RAM budget {format_size(budget)}"
    )
    if config.ram_format != "auto":
        return FormatChoice(
            config.ram_format, f"set explicitly ({sizes})", decoded_bytes, stored_bytes, budget
        )
    ssd_holds_store = config.ssd_dir is not None and config.ssd_bytes >= stored_bytes
    if budget >= decoded_bytes:
        why = "the decoded data fits the RAM budget"
    elif not ssd_holds_store and budget >= stored_bytes:
        return FormatChoice(
            "encoded",
            f"the compressed store fits the RAM budget, the decoded data does not, "
            f"and no SSD tier holds the store ({sizes})",
            decoded_bytes,
            stored_bytes,
            budget,
        )
    else:
        share = budget / decoded_bytes if decoded_bytes else 1.0
        rest = "the SSD tier serves" if ssd_holds_store else "the SSD tier and the origin serve"
        why = (  # rounded down: a budget just short of the data is not "100%"
            f"{math.floor(share * 100)}% of the decoded data fits and stays resident; {rest} "
            "the rest as compressed chunks"
        )
    if not whole_shards:
        why += (
            "; the store is read by ranges, so the reads fill the tier with the chunks they decode"
        )
    return FormatChoice(
        "decoded" if whole_shards else "chunks",
        f"{why} ({sizes})",
        decoded_bytes,
        stored_bytes,
        budget,
    )


def record(directory: str | None, store_id: str, choice: FormatChoice) -> None:
    """Write the choice where ``zstore cache stats`` finds it (best effort)."""
    if directory and make_dir(directory) is None:
        write_json(os.path.join(directory, f"{store_id}.json"), asdict(choice))


def recorded(directory: str | None) -> dict[str, dict[str, object]]:
    """Every recorded choice in ``directory``: store id -> choice, the latest first."""
    found: list[tuple[float, str, dict[str, object]]] = []
    for name, path in _records(directory):
        try:
            with open(path) as f:
                found.append((os.stat(f.fileno()).st_mtime, name[:-5], json.load(f)))
        except (OSError, ValueError):
            pass
    found.sort(key=lambda t: (-t[0], t[1]))
    return {store_id: choice for _, store_id, choice in found}


def forget(directory: str | None) -> None:
    """Remove every recorded choice in ``directory`` (``zstore cache clear``)."""
    for _, path in _records(directory):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _records(directory: str | None) -> list[tuple[str, str]]:
    if not directory or not os.path.isdir(directory):
        return []
    return [
        (name, os.path.join(directory, name))
        for name in sorted(os.listdir(directory))
        if name.endswith(".json")
    ]
