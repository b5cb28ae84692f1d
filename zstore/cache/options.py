"""Options for the cache tiers, with human sizes and ``ZSTORE_*`` environment variables.

Precedence: an argument given to :class:`CacheConfig` wins over the environment,
which wins over the defaults.  So a ``torchrun`` launch can set the cache once for
every rank with environment variables, and a script can still pin a field.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any

from zstore.errors import ConfigError
from zstore.units import format_size, parse_size
from zstore.urls import disk_usage_under, on_local_disk

AUTO = "auto"
RAM_FORMATS = ("auto", "chunks", "decoded", "encoded")
FILLS = ("auto", "process", "thread")


def _meminfo_bytes(field: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def default_ram_dir() -> str | None:
    """``/dev/shm/zstore-<uid>`` (one per user) where a tmpfs is mounted at ``/dev/shm``,
    else no RAM tier."""
    return f"/dev/shm/zstore-{os.getuid()}" if os.path.isdir("/dev/shm") else None


def default_ssd_dir() -> str:
    """``$XDG_CACHE_HOME/zstore`` or ``~/.cache/zstore``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "zstore")


def _free_bytes(path: str) -> int:
    usage = disk_usage_under(path)
    return usage.free if usage is not None else 0


def _total_bytes(path: str) -> int:
    usage = disk_usage_under(path)
    return usage.total if usage is not None else 0


#: A tier's budget is at most this share of the file system that holds it: a tier
#: filling its file system fails its own index ("database or disk is full") and every
#: write, and is then read past by every process until it is cleared.
FS_SHARE = 0.9
_FITTED: set[tuple[int, str]] = set()


def fitted_budget(name: str, directory: str, budget: int, origin: str) -> int:
    """``budget``, or :data:`FS_SHARE` of the file system under ``directory`` where the
    budget is larger (one warning per process and directory naming both sizes)."""
    total = _total_bytes(directory)
    cap = int(total * FS_SHARE)
    if not total or budget <= cap:
        return budget
    if (os.getpid(), directory) not in _FITTED:
        _FITTED.add((os.getpid(), directory))
        grow = (
            "mount -o remount,size=<budget + 10%> /dev/shm, as root"
            if name == "RAM"
            else "a larger disk"
        )
        warnings.warn(
            f"zstore {name} tier at {directory}: its budget ({format_size(budget)}, "
            f"{origin}) is larger than the file system that holds it "
            f"({format_size(total)}); it keeps to {format_size(cap)} ({FS_SHARE:.0%} of "
            f"it) instead, since a full file system stops the tier. Grow it ({grow}) or "
            f"lower {origin}",
            stacklevel=4,
        )
    return cap


def default_ram_bytes(ram_dir: str) -> int:
    """Half the free tmpfs, and at most a quarter of the machine's RAM."""
    return int(min(_free_bytes(ram_dir) * 0.5, _meminfo_bytes("MemTotal") * 0.25))


def default_ssd_bytes(ssd_dir: str) -> int:
    """Half the free space on the disk that holds the SSD tier."""
    return int(_free_bytes(ssd_dir) * 0.5)


_ENV = {
    "ram_bytes": "ZSTORE_RAM_BYTES",
    "ram_dir": "ZSTORE_RAM_DIR",
    "ram_format": "ZSTORE_RAM_FORMAT",
    "ssd_bytes": "ZSTORE_SSD_BYTES",
    "ssd_dir": "ZSTORE_SSD_DIR",
    "fetch": "ZSTORE_FETCH",
    "max_requests": "ZSTORE_MAX_REQUESTS",
    "shared_group": "ZSTORE_SHARED_GROUP",
    "fills": "ZSTORE_FILLS",
}
_OFF = {"", "none", "off", "0", "false"}


@dataclass(frozen=True)
class CacheConfig:
    """Where the node-shared cache tiers live and how large they may grow.

    Every field accepts ``"auto"`` (the default), which reads the matching
    ``ZSTORE_*`` environment variable and otherwise picks the default below.

    Args:
        ram_bytes: byte budget of the RAM tier for the whole node (int or "64GB").
            Default: half the free tmpfs, at most a quarter of RAM.  0 disables it.
        ram_dir: the RAM tier's directory, on tmpfs.  Default ``/dev/shm/zstore-<uid>``.
            ``None`` disables the tier.
        ram_format: ``"auto"`` (the default) chooses per store from its decoded
            and compressed size against the budget (see :mod:`zstore.cache.ram_format`);
            ``"decoded"`` keeps whole decoded shards in RAM (fast hits, about 2x the
            room); ``"encoded"`` keeps the compressed bytes.
        ssd_bytes: byte budget of the SSD tier.  Default: half the disk's free space.
        ssd_dir: the SSD tier's directory, on local disk.  Default
            ``~/.cache/zstore``, for stores behind a URL or on a network file system:
            a store on a local disk is read from it directly (an SSD tier would copy it
            to a disk of the same kind: epoch 0 at half the speed, later epochs no
            faster); name a directory to have one anyway.  ``None`` disables the tier.
        fetch: ``"range"`` reads only the chunks a window needs (each kept as its own
            SSD value, fetched once for the node under its locks), ``"slots"`` reads
            them the same way into one slotted SSD value per shard, written as they
            decode (no lock), ``"shard"`` reads a whole shard on first touch,
            ``"auto"`` picks by origin kind, round trip and budget.
        max_requests: origin requests in flight per process.
        shared_group: a group (name or gid) whose members share the tiers: directories
            ``2770`` owned by it, files ``0660``.  Every member can then feed every
            other member's training.  Default: none, the tiers are private to the user
            (``0700``); a tier directory others can write is refused.
        fills: where a process builds the whole shards its first reads leave to be
            filled into a RAM tier of whole shards (``decoded``/``encoded``):
            ``"process"``, a helper process of its own at the lowest priority (off the
            reading process's interpreter lock, on a core the reads leave idle);
            ``"thread"``, a thread of the reading process; ``"auto"`` (the default), a
            process for a store of packed items where the node's reading processes
            (local ranks x DataLoader workers) are fewer than its cores, else a thread.

    Environment: ``ZSTORE_RAM_BYTES``, ``ZSTORE_RAM_DIR``, ``ZSTORE_RAM_FORMAT``,
    ``ZSTORE_SSD_BYTES``, ``ZSTORE_SSD_DIR``, ``ZSTORE_FETCH``,
    ``ZSTORE_MAX_REQUESTS``, ``ZSTORE_SHARED_GROUP``, ``ZSTORE_FILLS``; ``none`` or an
    empty value disables a directory.
    """

    ram_bytes: int | str = AUTO
    ram_dir: str | os.PathLike[str] | None = AUTO
    ram_format: str = AUTO
    ssd_bytes: int | str = AUTO
    ssd_dir: str | os.PathLike[str] | None = AUTO
    fetch: str = AUTO
    max_requests: int | str = AUTO
    shared_group: str | int | None = AUTO
    fills: str = AUTO

    def resolved(self) -> ResolvedCache:
        """Apply environment variables and defaults; validate every field."""
        raw: dict[str, Any] = {}
        origin: dict[str, str] = {}  # where each value came from, for error messages
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            origin[field.name] = field.name
            if isinstance(value, str) and value == AUTO:
                env = _ENV[field.name]
                value = os.environ.get(env, AUTO)
                if value != AUTO:
                    origin[field.name] = f"{env} (environment)"
            raw[field.name] = value
        ram_dir = _resolve_dir(raw["ram_dir"], default_ram_dir())
        ssd_dir = _resolve_dir(raw["ssd_dir"], default_ssd_dir())
        ram_bytes = (
            0
            if ram_dir is None
            else _resolve_bytes(
                raw["ram_bytes"], origin["ram_bytes"], lambda: default_ram_bytes(ram_dir)
            )
        )
        ssd_bytes = (
            0
            if ssd_dir is None
            else _resolve_bytes(
                raw["ssd_bytes"], origin["ssd_bytes"], lambda: default_ssd_bytes(ssd_dir)
            )
        )
        if ram_dir is not None and ram_bytes:
            ram_bytes = fitted_budget("RAM", ram_dir, ram_bytes, origin["ram_bytes"])
        if ssd_dir is not None and ssd_bytes:
            ssd_bytes = fitted_budget("SSD", ssd_dir, ssd_bytes, origin["ssd_bytes"])
        ram_format = str(raw["ram_format"])
        if ram_format not in RAM_FORMATS:
            raise ConfigError(
                f"{origin['ram_format']} must be 'auto', 'chunks', 'decoded' or 'encoded', "
                f"got {ram_format!r}"
            )
        fetch = str(raw["fetch"])
        if fetch not in ("auto", "range", "shard", "slots"):
            raise ConfigError(
                f"{origin['fetch']} must be 'auto', 'range', 'shard' or 'slots', got {fetch!r}"
            )
        fills = str(raw["fills"])
        if fills not in FILLS:
            raise ConfigError(
                f"{origin['fills']} must be 'auto', 'process' or 'thread', got {fills!r}"
            )
        max_requests = (
            16
            if raw["max_requests"] == AUTO
            else _whole(raw["max_requests"], origin["max_requests"])
        )
        if not 1 <= max_requests <= 1024:
            raise ConfigError(
                f"{origin['max_requests']} must be from 1 to 1024 origin "
                f"requests in flight, got {max_requests}"
            )
        return ResolvedCache(
            ram_dir=ram_dir if ram_bytes else None,
            ram_bytes=ram_bytes,
            ssd_dir=ssd_dir if ssd_bytes else None,
            ssd_bytes=ssd_bytes,
            ssd_auto=raw["ssd_dir"] == AUTO,
            ram_format=ram_format,
            fetch=fetch,
            max_requests=max_requests,
            shared_gid=_resolve_group(raw["shared_group"], origin["shared_group"]),
            fills=fills,
        )


@dataclass(frozen=True)
class ResolvedCache:
    """A :class:`CacheConfig` with every default applied (what the tiers use)."""

    ram_dir: str | None
    ram_bytes: int
    ssd_dir: str | None
    ssd_bytes: int
    ram_format: str
    fetch: str
    max_requests: int
    shared_gid: int | None = None
    #: the SSD tier's directory is the default (no argument, no ZSTORE_SSD_DIR): a reader
    #: of a store on a local disk then goes without it (:meth:`for_store`)
    ssd_auto: bool = False
    #: where the fills behind the reads run (:class:`CacheConfig`'s ``fills``)
    fills: str = AUTO

    def for_store(self, url: str, *, origin_fs: Any = None) -> ResolvedCache:
        """These tiers as a reader of the store at ``url`` uses them: without the default
        SSD tier when the store is on a local disk (:func:`zstore.urls.on_local_disk`)
        and read through no other file system: it is read from there directly (an SSD
        tier would copy it to a disk of the same kind)."""
        if self.ssd_dir and self.ssd_auto and origin_fs is None and on_local_disk(url):
            return dataclasses.replace(self, ssd_dir=None, ssd_bytes=0)
        return self


def _resolve_dir(value: Any, default: str | None) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and value == AUTO:
        return default
    if isinstance(value, str) and value.strip().lower() in _OFF:
        return None
    return os.path.abspath(os.path.expanduser(os.fspath(value)))


def _resolve_group(value: Any, name: str) -> int | None:
    """The gid of the group the tiers are shared with, or None (private tiers)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _OFF | {AUTO}):
        return None
    from zstore.cache.ownership import group_id

    try:
        return group_id(value if isinstance(value, int) else str(value).strip())
    except KeyError:
        raise ConfigError(
            f"{name}: there is no group {value!r} on this machine; name an "
            "existing group (see 'getent group') or leave it unset"
        ) from None


def _whole(value: Any, name: str) -> int:
    """A whole number from an argument or an environment variable's text."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a whole number, got {value!r}")
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise ConfigError(f"{name} must be a whole number, got {value!r}") from None


def _resolve_bytes(value: Any, name: str, default: Any) -> int:
    if isinstance(value, str) and value == AUTO:
        return default()
    return parse_size(value, name=name)


def as_cache_config(cache: CacheConfig | bool | None) -> CacheConfig | None:
    """``None``/``True`` -> defaults from the environment, ``False`` -> no cache."""
    if cache is None or cache is True:
        return CacheConfig()
    if cache is False:
        return None
    if not isinstance(cache, CacheConfig):
        raise ConfigError(f"cache must be a zstore.CacheConfig, None or False, got {cache!r}")
    return cache
