"""``zstore cache warm``: fill the node's tiers from the origin before the first epoch."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Sequence
from typing import Any

from zstore.config import CacheConfig
from zstore.layout import Span
from zstore.reader import WindowReader
from zstore.store import read_manifest


def warm(url: str, *, fields: Sequence[str] | None = None, cache: CacheConfig | None = None,
         storage_options: dict[str, Any] | None = None, workers: int = 4,
         progress: bool = True) -> dict[str, int]:
    """Read every chunk of ``fields`` once, so the tiers hold them (within their budgets)."""
    from tqdm import tqdm

    config = cache or CacheConfig()
    manifest, _ = read_manifest(url, storage_options)
    names = list(fields) if fields else manifest.time_arrays
    local = threading.local()

    def one(item: str) -> int:
        reader = getattr(local, "reader", None)
        if reader is None:  # one reader per thread: its maps are not thread-safe
            reader = local.reader = WindowReader(url, cache=config,
                                                 storage_options=storage_options).open()
        spans = {n: Span(0, reader.layout(item, n).length) for n in names}
        return sum(a.nbytes for a in reader.read(item, spans).values())

    total = 0
    with cf.ThreadPoolExecutor(max(1, workers)) as pool, \
            tqdm(total=len(manifest.items), desc="warm", unit="item", disable=not progress) as bar:
        for nbytes in pool.map(one, manifest.items):
            total += nbytes
            bar.update(1)
    return {"items": len(manifest.items), "bytes": total}
