"""How much a store's fields take: decoded and stored bytes, shard and chunk counts.

From the manifest (lengths) and the first item's array metadata (the other axes,
dtype, chunking), so it costs nothing per item beyond a sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zstore.layout import Manifest, parse_array_meta


@dataclass(frozen=True)
class Sizes:
    """Totals over every item for the fields asked for."""

    decoded_bytes: int
    stored_bytes: int
    shards: int
    chunks: int


def field_sizes(manifest: Manifest, metas: Any,
                fields: Sequence[str] | None = None) -> Sizes:
    """Decoded and (estimated) stored bytes, shards and chunks of ``fields`` (default:
    every time array).  Stored bytes are the store's bytes in proportion to the fields'
    share of the decoded bytes (the manifest does not split them by array)."""
    names = [n for n in (fields or manifest.time_arrays) if n in manifest.lengths]
    decoded = shards = chunks = 0
    everything = 0
    for name in manifest.time_arrays:
        first = manifest.first_index(name)
        meta = metas.at(first, name) if first is not None else None
        if meta is None:
            continue
        layout = parse_array_meta(name, meta, manifest.arrays[name].time_axis)
        lengths = np.asarray(manifest.lengths[name], dtype=np.int64)
        lengths = lengths[lengths >= 0]
        nbytes = layout.step_nbytes * int(lengths.sum())
        everything += nbytes
        if name in names:
            decoded += nbytes
            shard = max(1, layout.shard if layout.length else 1)
            shards += int((-(-lengths // shard)).sum())
            chunks += int((-(-lengths // max(1, layout.chunk))).sum())
    total = int(manifest.extra.get("store_bytes", 0))
    stored = int(total * decoded / everything) if everything else total
    return Sizes(decoded, stored, shards, chunks)
