"""The tiers composed: RAM tier -> SSD tier -> origin, keyed by (store id, key)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any

from zstore.cache._location import refusal
from zstore.cache._locks import StripedLocks
from zstore.cache._stats import (
    Stats,
    live_processes,
    mark,
    read_since_mark,
    read_stats,
    summarize,
)
from zstore.cache.options import CacheConfig, ResolvedCache
from zstore.cache.ownership import describe, problem
from zstore.cache.ram_format import forget, recorded
from zstore.cache.tier import Tier

_REFUSED: set[tuple[int, str]] = set()  # (pid, directory): warned once per process


def safe_dirs(config: ResolvedCache) -> tuple[str | None, str | None]:
    """The RAM and SSD tier directories this process may use: each is refused, with one
    warning naming it, its owner and mode, unless only this user (or, opted in, the
    shared group) can write it (see :mod:`zstore.cache.ownership`)."""
    out = []
    for name, directory in (("ram", config.ram_dir), ("ssd", config.ssd_dir)):
        why = refusal(directory, config.shared_gid) if directory else None
        if why:
            if (os.getpid(), directory) not in _REFUSED:
                _REFUSED.add((os.getpid(), directory))  # type: ignore[arg-type]
                warnings.warn(
                    f"zstore {name} tier refused: {why}; reading through to the "
                    "next tier or the origin",
                    stacklevel=3,
                )
            directory = None
        out.append(directory)
    return out[0], out[1]


def node_dir(config: ResolvedCache, name: str) -> str | None:
    """A directory every process on the node shares: under the RAM tier, else the SSD tier
    (only a tier directory that passed the ownership check)."""
    return _under(*safe_dirs(config), name)


def _under(ram_dir: str | None, ssd_dir: str | None, name: str) -> str | None:
    base = ram_dir or ssd_dir
    return os.path.join(base, name) if base else None


class TieredCache:
    """Node-shared tiers in front of an origin.

    A value found in the SSD tier is promoted to RAM; a value fetched from the
    origin fills both.  ``ram=False`` keeps a value out of the RAM tier (used when
    the RAM tier holds decoded shards instead).  Keys are prefixed with the
    store's id, so two stores, or a reconverted store, never share entries; and with
    the id of the append that wrote the object, where ``lineage`` names one
    (:mod:`zstore.format.lineage`: copies of a store share its id, not what their
    appends wrote).
    """

    def __init__(
        self, config: ResolvedCache, namespace: str, lineage: Callable[[str], str] | None = None
    ):
        self.config = config
        self.namespace = namespace
        #: key -> the id of the append that wrote its object ("": the store id alone)
        self.lineage = lineage
        ram_dir, ssd_dir = safe_dirs(config)  # checked once; node_dir() uses them
        self._dirs = (ram_dir, ssd_dir)
        self.stats = Stats(self.node_dir("stats"))
        gid = config.shared_gid
        self.ram = (
            Tier("ram", ram_dir, config.ram_bytes, self.stats, admission=True, gid=gid, record=True)
            if ram_dir and config.ram_bytes
            else None
        )
        self.ssd = (
            Tier("ssd", ssd_dir, config.ssd_bytes, self.stats, admission=True, gid=gid, record=True)
            if ssd_dir and config.ssd_bytes
            else None
        )
        #: What the RAM tier holds for this store: "chunks", "decoded" or "encoded" (the
        #: reader settles "auto" once it knows the store's size, see
        #: zstore.cache.ram_format).
        self.ram_format = config.ram_format if config.ram_format != "auto" else "decoded"
        lock_dir = self.node_dir("locks")
        self.fill_locks = StripedLocks(lock_dir, "e") if lock_dir else None
        self.decode_locks = StripedLocks(lock_dir, "d") if lock_dir else None

    @property
    def decoded(self) -> bool:
        """True when the RAM tier holds decoded chunks or shards (the reader's fast path)."""
        return self.ram is not None and self.ram_format in ("chunks", "decoded")

    def node_dir(self, name: str) -> str | None:
        """Like the module's :func:`node_dir`, from the directories checked at start."""
        return _under(*self._dirs, name)

    def live_processes(self) -> set[int]:
        """The node's running processes that have used these tiers (their counters)."""
        return live_processes(self.stats.directory)

    def key(self, key: str) -> str:
        if self.lineage is not None:
            written_by = self.lineage(key)
            if written_by:
                return f"{self.namespace}.{written_by}/{key}"
        return f"{self.namespace}/{key}"

    def lookup(
        self, key: str, *, ram: bool = True, again: bool = False
    ) -> bytes | memoryview | None:
        """The value from the tiers only, or None (``again``: a recheck, misses not counted)."""
        k = self.key(key)
        if ram and self.ram is not None:
            value = self.ram.get(k, count_miss=not again)
            if value is not None:
                return value
        if self.ssd is not None:
            value = self.ssd.get(k, count_miss=not again)
            if value is not None:
                if ram and self.ram is not None:
                    self.ram.put(k, value)
                return value
        return None

    def lookup_many(
        self,
        keys: Sequence[str],
        *,
        ram: bool = True,
        into: Callable[[int], memoryview | None] | None = None,
    ) -> list[bytes | memoryview | None]:
        """Like :meth:`lookup` for many keys: one index query per tier (``into``: see
        :meth:`Tier.get_many`)."""
        names = [self.key(k) for k in keys]
        values: list[bytes | memoryview | None] = [None] * len(keys)
        if ram and self.ram is not None:
            values = list(self.ram.get_many(names, into=into))
        todo = [i for i, v in enumerate(values) if v is None]
        if todo and self.ssd is not None:
            found = self.ssd.get_many([names[i] for i in todo], into=into)
            for i, value in zip(todo, found):
                if value is not None:
                    values[i] = value
                    if ram and self.ram is not None:
                        self.ram.put(names[i], value)
        return values

    def fill(self, key: str, value: bytes | memoryview, *, ram: bool = True) -> None:
        self.fill_many([(key, value)], ram=ram)

    def fill_many(self, values: list[tuple[str, bytes | memoryview]], *, ram: bool = True) -> None:
        """Put each (key, value) in the tiers, one index transaction per tier."""
        named = [(self.key(k), v) for k, v in values]
        if self.ssd is not None:
            self.ssd.put_many(named)
        if ram and self.ram is not None:
            self.ram.put_many(named)

    def get(self, key: str, fetch: Callable[[], bytes], *, ram: bool = True) -> bytes:
        """The value for ``key`` from the first tier that has it, else from ``fetch()``."""
        return self.get_many([key], lambda _: [fetch()], ram=ram)[0]  # type: ignore[return-value]

    def get_many(
        self,
        keys: Sequence[str],
        fetch_many: Callable[[list[str]], list[bytes | memoryview | None]],
        *,
        ram: bool = True,
        passing: Collection[str] = (),
        into: Callable[[int], memoryview | None] | None = None,
        wait: bool = True,
    ) -> list[bytes | memoryview | None]:
        """Like :meth:`get` for many keys; the misses are fetched in one call.

        ``fetch_many`` returns None for a key missing at the origin; that is
        passed on and never cached.  Keys in ``passing`` are fetched with the others
        but neither locked nor kept (ranges of a shard another process is putting in
        the tiers whole).  ``into``: memory for the tiers' hits (:meth:`Tier.get_many`).
        ``wait=False``: a key whose node lock another holder has now is fetched as if
        in ``passing`` instead of waiting for that lock.
        """
        values = self.lookup_many(keys, ram=ram, into=into)
        missing = [i for i, v in enumerate(values) if v is None]
        stored = self.ssd is not None or (ram and self.ram is not None)
        locked = [keys[i] for i in missing if keys[i] not in passing] if stored else []
        if not locked or self.fill_locks is None:
            # No lock when no tier keeps what is fetched (RAM-only tiers reading a
            # shard's chunks for a window): there is no fill to wait for, and the
            # locks are striped, so a batch's hundreds of keys would wait for other
            # processes' unrelated fetches (4 ranks: a quarter of epoch 0's time).
            return self._fetch_into(keys, values, missing, fetch_many, ram, passing)
        busy: set[str] = set()
        if wait:
            fds = self.fill_locks.acquire(locked) or []  # None only without waiting
        else:
            fds, busy = self.fill_locks.acquire_free(locked)
        skipped = {*passing, *busy}
        try:
            # Another process may have filled them while this one waited.
            for i in missing:
                if keys[i] not in skipped:
                    values[i] = self.lookup(keys[i], ram=ram, again=True)
            missing = [i for i in missing if values[i] is None]
            return self._fetch_into(keys, values, missing, fetch_many, ram, skipped)
        finally:
            self.fill_locks.release(fds)

    def _fetch_into(
        self,
        keys: Sequence[str],
        values: list[bytes | memoryview | None],
        missing: list[int],
        fetch_many: Callable[[list[str]], list[bytes | memoryview | None]],
        ram: bool,
        passing: Collection[str] = (),
    ) -> list[bytes | memoryview | None]:
        if missing:
            fetched = fetch_many([keys[i] for i in missing])
            for i, value in zip(missing, fetched):
                values[i] = value
            self.fill_many(
                [
                    (keys[i], v)
                    for i, v in zip(missing, fetched)
                    if v is not None and keys[i] not in passing
                ],
                ram=ram,
            )
        return values

    def usage(self) -> dict[str, Any]:
        return {t.name: t.usage() for t in (self.ram, self.ssd) if t is not None}


def _tiers(config: ResolvedCache) -> list[Tier]:
    stats = Stats(None)
    ram_dir, ssd_dir = safe_dirs(config)
    tiers = []
    if ram_dir and config.ram_bytes:
        tiers.append(Tier("ram", ram_dir, config.ram_bytes, stats, gid=config.shared_gid))
    if ssd_dir and config.ssd_bytes:
        tiers.append(Tier("ssd", ssd_dir, config.ssd_bytes, stats, gid=config.shared_gid))
    return tiers


def cache_stats(cache: CacheConfig | None = None) -> dict[str, Any]:
    """Hits, misses, evictions and bytes per tier, summed over every process on the node."""
    config = (cache or CacheConfig()).resolved()
    usage = {t.name: t.usage() for t in _tiers(config)}
    stats_dir = node_dir(config, "stats")
    result = summarize(read_stats(stats_dir), usage)
    result["running"] = summarize(read_stats(stats_dir, live_only=True), {})
    since = read_since_mark(stats_dir)
    result["since_mark"] = summarize(since, {}) if since is not None else None
    result["config"] = {
        "ram_dir": config.ram_dir,
        "ram_bytes": config.ram_bytes,
        "ssd_dir": config.ssd_dir,
        "ssd_bytes": config.ssd_bytes,
        "ram_format": config.ram_format,
        "shared_gid": config.shared_gid,
    }
    for name in ("ram", "ssd"):
        directory = result["config"][f"{name}_dir"]
        if directory:
            result[name]["directory"] = directory
            result[name]["ownership"] = describe(directory)
            result[name]["refused"] = problem(directory, config.shared_gid)
    result["formats"] = recorded(node_dir(config, "formats"))
    return result


def mark_stats(cache: CacheConfig | None = None) -> None:
    """Start counting "since the mark" now (``zstore cache mark``)."""
    mark(node_dir((cache or CacheConfig()).resolved(), "stats"))


def clear_cache(cache: CacheConfig | None = None) -> None:
    """Empty every tier, reset the counters and forget the RAM formats recorded per
    store (a reader records its store's again when it next opens it)."""
    config = (cache or CacheConfig()).resolved()
    for tier in _tiers(config):
        tier.clear()
    forget(node_dir(config, "formats"))
    directory = node_dir(config, "stats")
    if directory and os.path.isdir(directory):
        for name in os.listdir(directory):
            if name.endswith(".bin") or name == "mark.counts":
                try:
                    os.unlink(os.path.join(directory, name))
                except FileNotFoundError:
                    pass
