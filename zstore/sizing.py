"""How much a store's fields take: decoded and stored bytes, shard and chunk counts.

From the manifest (lengths) and the first item's array metadata (the other axes,
dtype, chunking), so it costs nothing per item beyond a sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zstore.layout import Manifest, parse_array_meta


@dataclass(frozen=True)
class Sizes:
    """Totals over every item for the fields asked for."""

    decoded_bytes: int
    stored_bytes: int
    shards: int
    chunks: int


def field_sizes(manifest: Manifest, metas: dict[str, Any],
                fields: Sequence[str] | None = None) -> Sizes:
    """Decoded and (estimated) stored bytes, shards and chunks of ``fields`` (default:
    every time array).  Stored bytes are the store's bytes in proportion to the fields'
    share of the decoded bytes (the manifest does not split them by array)."""
    names = [n for n in (fields or manifest.time_arrays) if n in manifest.lengths]
    decoded = shards = chunks = 0
    everything = 0
    for name in manifest.time_arrays:
        meta = metas.get(f"{manifest.first_with(name)}/{name}")
        if meta is None:
            continue
        layout = parse_array_meta(name, meta, manifest.arrays[name].time_axis)
        lengths = [n for n in manifest.lengths[name] if n >= 0]
        nbytes = layout.step_nbytes * sum(lengths)
        everything += nbytes
        if name in names:
            decoded += nbytes
            shard = max(1, layout.shard if layout.length else 1)
            shards += sum(-(-n // shard) for n in lengths)
            chunks += sum(-(-n // max(1, layout.chunk)) for n in lengths)
    total = int(manifest.extra.get("store_bytes", 0))
    stored = int(total * decoded / everything) if everything else total
    return Sizes(decoded, stored, shards, chunks)
