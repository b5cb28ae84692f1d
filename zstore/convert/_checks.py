"""The converter's checks of its options, before anything is read or written: numbers
it cannot use are refused with one line that says what to give."""

from __future__ import annotations

import math
from typing import Any

from zstore.convert._source import SourcePlan
from zstore.errors import SourceError
from zstore.format import PACK_SECONDS

#: chunk_seconds bounds: below 10 ms the per-chunk overhead (index entry, crc32c, codec
#: header: ~36 bytes) outweighs small arrays' data; above an hour a window reads far
#: more than it needs.
MIN_CHUNK_SECONDS, MAX_CHUNK_SECONDS = 0.01, 3600.0


def check_options(chunk_seconds: Any, workers: Any) -> None:
    """Refuse numbers the converter cannot use, before the destination is touched."""
    if (
        isinstance(chunk_seconds, bool)
        or not isinstance(chunk_seconds, (int, float))
        or not math.isfinite(chunk_seconds)
        or not MIN_CHUNK_SECONDS <= chunk_seconds <= MAX_CHUNK_SECONDS
    ):
        raise SourceError(
            f"--chunk-seconds {chunk_seconds!r}: must be a number from {MIN_CHUNK_SECONDS:g} "
            f"to {MAX_CHUNK_SECONDS:g} (shorter chunks cost more in per-chunk overhead than "
            "they hold; longer ones make windows read far more than they need); 1.0 suits "
            "windows of a few seconds"
        )
    if workers is not None and (
        isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
    ):
        raise SourceError(
            f"--workers {workers!r}: must be a whole number of processes, at "
            "least 1 (leave it out for one per CPU)"
        )


def check_pack_seconds(pack_seconds: Any) -> None:
    """``pack_seconds`` must be a number of seconds, 0 or more."""
    if (
        isinstance(pack_seconds, bool)
        or not isinstance(pack_seconds, (int, float))
        or not math.isfinite(pack_seconds)
        or pack_seconds < 0
    ):
        raise SourceError(
            f"--pack-seconds {pack_seconds!r}: must be a number of seconds, 0 or more "
            f"(items no longer than it are packed; 0 packs none; default {PACK_SECONDS:g})"
        )


def check_dataset_items(name: Any) -> None:
    """``dataset_items`` must be a plain array name."""
    if not isinstance(name, str) or not name or "/" in name or name.startswith("zstore"):
        raise SourceError(
            f"--dataset-items {name!r}: must be the name each recording's array gets "
            "(e.g. wav): not empty, without '/', and not starting with 'zstore'"
        )


def check_chunks(source: SourcePlan, chunk_seconds: float) -> None:
    """Each time array's chunk must hold at least one sample at its rate."""
    for name, info in source.arrays.items():
        if info.rate is not None and info.rate * chunk_seconds < 1:
            raise SourceError(
                f"--rate {name}={info.rate:g} with --chunk-seconds {chunk_seconds:g}: a chunk "
                "would hold less than one sample (rates are samples per second, e.g. "
                f"--rate {name}=16000); give the real rate or longer chunks"
            )
