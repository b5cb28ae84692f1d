"""What ``fetch="auto"`` picks for a remote store with an SSD tier: each shard object
whole at its first touch (``"shard"``, :mod:`zstore.read._whole_fetch`) where the SSD
tier holds the store and a round trip is long, else ranges kept in the SSD tier's
slotted shards (``"slots"``, :mod:`zstore.read._ssd_slots`).

Whole shards pay off where a round trip is long: the chunks the first epoch does not
touch would each cost one later.  Where it is short (a network file system), the
first touch of each shard waits for the whole object and writes it, and the first
epoch read at 0.72-0.80x of no tiers, against 0.94x into the slots (NFS-like origin,
1 ms; S3-like, 20 ms: whole shards 2.0x of no tiers in epoch 0 and ~2,400-3,200
windows/s in epoch 1, by ranges 1.7x and 904; docs/benchmarks-notes.md, "The SSD
tier filled by the reads").

The first process of a node to open a store times two small reads of its root, and
writes the seconds in the node's directory; the node's other processes (ranks and
their workers) read that record, so they agree on the form their SSD tier keeps.
"""

from __future__ import annotations

import json
import os

from crc32c import crc32c

from zstore.cache import make_dir
from zstore.cache.files import write_json
from zstore.origin import Origin

#: a round trip at least this long (seconds) fetches whole shards
FAR = 0.005


def round_trip(origin: Origin, directory: str | None, store_id: str) -> float:
    """Seconds of one small read of the store at ``origin``, as the node's first process
    to open it there measured them (recorded in ``directory``, best effort; by store
    and URL: a copy of the store elsewhere is timed anew)."""
    name = f"{store_id}-{crc32c(origin.url.encode()):08x}.json"
    path = os.path.join(directory, name) if directory and store_id else None
    if path is not None:
        try:
            with open(path) as f:
                return float(json.load(f)["seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    seconds = origin.round_trip()
    if path is not None and directory and make_dir(directory) is None:
        write_json(path, {"seconds": seconds})
    return seconds


def whole_shards(origin: Origin, directory: str | None, store_id: str) -> bool:
    """Whether ``fetch="auto"`` reads a remote store's shards whole (see the module)."""
    return round_trip(origin, directory, store_id) >= FAR
