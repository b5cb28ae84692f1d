"""``zstore cache warm``: fill the node's tiers from the origin before the first epoch."""

from __future__ import annotations

import concurrent.futures as cf
import pickle
import threading
from collections.abc import Sequence
from typing import Any

from zstore.cache import CacheConfig
from zstore.errors import ConfigError
from zstore.format import Span, read_manifest
from zstore.read import WindowReader, complete_in, form_key


def warm(
    url: str,
    *,
    fields: Sequence[str] | None = None,
    cache: CacheConfig | None = None,
    storage_options: dict[str, Any] | None = None,
    workers: int = 4,
    progress: bool = True,
    nodes: int | None = None,
    node_rank: int | None = None,
    seed: int = 0,
) -> dict[str, int]:
    """Read every chunk of ``fields`` once, so the tiers hold them (within their budgets).

    When the SSD tier can hold the whole store, it keeps each shard as one object (read
    whole from the origin), which a window reads by slicing its map (see
    :mod:`zstore.read._ssd_shards`); otherwise it keeps the chunks the reads fill.

    ``nodes``/``node_rank``: warm only the items ``zstore.NodeSampler`` (same ``seed``,
    every item served) assigns to node ``node_rank`` of ``nodes``.
    """
    from tqdm import tqdm

    config = cache or CacheConfig()
    first = WindowReader(url, cache=config, storage_options=storage_options).open()
    manifest = first.manifest  # the item table comes from the node's copy after this
    names = _time_fields(url, manifest, fields)
    items = list(manifest.items)
    positions = {name: i for i, name in enumerate(items)}
    have: dict[str, set[int] | None] = {}
    for n in names:
        with_n = manifest.items_with(n)
        have[n] = None if with_n is None else set(int(i) for i in with_n)
    if nodes is not None:
        items = node_share(manifest, names, nodes, node_rank, seed)
    local = threading.local()

    def one(item: str) -> int:
        reader = getattr(local, "reader", None)
        if reader is None:  # one reader per thread: its maps are not thread-safe
            reader = local.reader = pickle.loads(pickle.dumps(first)).open()
            if reader.form is not None:  # warming waits for its builds
                reader.form.inline = True
            reader.start_builds()  # its whole-shard SSD writes run behind its fetches
        position = positions[item]
        spans = {
            n: Span(0, reader.placed(item, n, position)[2])
            for n in names
            if (got := have[n]) is None or position in got
        }  # arrays some items lack
        if first.ssd_holds_store:  # a no-op where the SSD tier was refused
            for n in spans:
                reader.source.keep_whole(reader.placed(item, n, position)[0])
        nbytes = reader.warm(item, spans, position)
        reader.settle()  # shards fetched whole are written behind the read: wait for them
        return nbytes

    total = 0
    with (
        cf.ThreadPoolExecutor(max(1, workers)) as pool,
        tqdm(total=len(items), desc="warm", unit="item", disable=not progress) as bar,
    ):
        for nbytes in pool.map(one, items):
            total += nbytes
            bar.update(1)
    return {"items": len(items), "bytes": total}


def node_share(
    manifest: Any, names: Sequence[str], nodes: int, node_rank: int | None, seed: int
) -> list[str]:
    """The items NodeSampler assigns to node ``node_rank`` of ``nodes``."""
    from zstore.errors import ConfigError
    from zstore.train import assign_nodes, common_lengths

    if nodes < 1 or node_rank is None or not 0 <= node_rank < nodes:
        raise ConfigError(
            f"--nodes {nodes} --node-rank {node_rank}: the node rank must be from 0 to {nodes - 1}"
        )
    timed = [n for n in names if manifest.arrays[n].rate is not None]
    rates = {n: float(manifest.arrays[n].rate) for n in timed}
    coarse = min(timed, key=lambda n: rates[n])
    lengths = common_lengths(manifest.lengths, rates, coarse)
    home = assign_nodes([max(0, n) for n in lengths], nodes, seed)
    return [item for item, node in zip(manifest.items, home) if node == node_rank]


def _time_fields(url: str, manifest: Any, fields: Sequence[str] | None) -> list[str]:
    """The arrays to warm: ``fields``, each a time array of the store (the tiers hold
    their shards), or every time array."""
    if not fields:
        return list(manifest.time_arrays)
    for name in fields:
        if name not in manifest.arrays:
            raise ConfigError(f"{url}: no array '{name}' (arrays: {', '.join(manifest.arrays)})")
        if name not in manifest.time_arrays:
            raise ConfigError(
                f"{url}: '{name}' is stored whole (no time axis): the tiers hold shards of "
                f"time arrays ({', '.join(manifest.time_arrays)}); leave it out of --fields"
            )
    return list(fields)


def share_residency(
    url: str,
    *,
    cache: CacheConfig | None = None,
    nodes: int = 1,
    node_rank: int = 0,
    seed: int = 0,
    fields: Sequence[str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """How much of a node's share of a store (as NodeSampler assigns it) the RAM tier
    holds now: shards of the share, and how many of them are resident (whole in any
    form: a shard the reads fill chunk by chunk counts once every chunk is in)."""
    from zstore.cache import TieredCache
    from zstore.format import lineage_of, parse_array_meta

    manifest, metas = read_manifest(url, storage_options)
    names = _time_fields(url, manifest, fields)
    items = node_share(manifest, names, nodes, node_rank, seed)
    tiers = TieredCache(
        (cache or CacheConfig()).resolved(), manifest.store_id, lineage_of(manifest)
    )
    db = tiers.ram._open() if tiers.ram is not None else None
    total = resident = 0
    for item in items:
        for name in names:
            meta = metas.get(f"{item}/{name}")
            if meta is None:
                continue
            info = manifest.arrays[name]
            layout = parse_array_meta(f"{item}/{name}", meta, info.time_axis, info.values)
            for s in range(-(-layout.length // layout.shard)):
                total += 1
                if db is not None and any(
                    form_key(tiers, layout, s, suffix, decoded) in db
                    for suffix, decoded in (("#D", True), ("#E", False))
                ):
                    resident += 1
                elif db is not None and complete_in(tiers, layout, s):
                    resident += 1
    return {
        "node": node_rank,
        "nodes": nodes,
        "items": len(items),
        "shards": total,
        "resident_in_ram": resident,
        "fraction": resident / total if total else 0.0,
    }
