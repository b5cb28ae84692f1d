"""One cache tier: a directory shared by every process on the node, with a byte budget.

The engine is :mod:`diskcache` (SQLite index + one file per value), which gives
process-safe inserts and lookups.  On top of it this module adds what diskcache
lacks: a header with length and crc32c on every value (checked on read; a bad
value is dropped and reported as a miss), a hard byte budget that counts the
index files (eviction runs *before* an insert, in the same transaction), page
rounding of sizes, a sweep of files left by killed writers, and graceful
degradation: any failure of the tier warns once and reads fall through.

Reads are :mod:`zstore.cache._tier_reads`, admission and writes
:mod:`zstore.cache._tier_writes`, the value files :mod:`zstore.cache._tier_files`.  Who
gives way in a full tier is :mod:`zstore.cache._space`; where a tier may live,
:mod:`zstore.cache._location`; the directory's upkeep, :mod:`zstore.cache._upkeep`.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import diskcache

import zstore.cache._upkeep as upkeep
from zstore.cache._evictions import EvictionLog
from zstore.cache._location import refusal
from zstore.cache._own import OwnWrites
from zstore.cache._space import Room
from zstore.cache._stats import Stats
from zstore.cache._tier_files import TierDisk
from zstore.cache._tier_reads import TierReads
from zstore.cache._tier_writes import TierWrites
from zstore.cache.files import fix_file
from zstore.cache.ownership import describe
from zstore.urls import network_fs_type


class Tier(TierReads, TierWrites):
    """A byte-budgeted, node-shared key -> bytes tier in ``directory``.

    ``get``/``put`` move packed values; ``get_mapped`` maps a value read-only and
    returns a zero-copy view of its payload.  Safe across processes and forks
    (connections are reopened in a new process), pickles as its settings.
    """

    def __init__(
        self,
        name: str,
        directory: str,
        budget: int,
        stats: Stats,
        admission: bool = False,
        gid: int | None = None,
        record: bool = False,
    ):
        self.name = name
        self.record = record  # write the budget where `zstore cache stats` finds it
        self.gid = gid  # shared with this group (opt-in), else private to this user
        self.directory = directory
        self.budget = int(budget)
        self.stats = stats
        self.admission = admission
        self.room = Room(name, directory, self.budget, stats, admission)
        self.sketch = self.room.sketch
        self.evictions = EvictionLog(directory)
        self._pid = -1
        self._cache: diskcache.Cache | None = None
        self._warned: set[str] = set()
        #: the RAM tier's values written through this object, mapped without their
        #: block checks (zstore.cache._own); the SSD tier's are checked (a device)
        self.own = OwnWrites() if name == "ram" else None

    def __getstate__(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "directory": self.directory,
            "budget": self.budget,
            "stats": self.stats,
            "admission": self.admission,
            "gid": self.gid,
            "record": self.record,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, **state)

    def _warn(self, what: str, exc: BaseException | str) -> None:
        self.stats.add(f"{self.name}_errors")
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(
                f"zstore {self.name} tier at {self.directory}: {what} ({exc}); "
                "reading through to the next tier or the origin",
                stacklevel=3,
            )

    def _open(self) -> diskcache.Cache | None:
        if self._pid == os.getpid():
            return self._cache
        self._warned = set()
        if self.own is not None:  # a forked child trusts what it writes, not its parent
            self.own = OwnWrites()
        self._cache = self._made()
        # set last: a thread that sees this process's pid takes the cache above.  Set
        # first, a second thread's first call, while the first was still opening the
        # index, got None (as for a refused tier) and its read went past the tier.  Two
        # threads that open it at once each open the index; the last one's stays.
        self._pid = os.getpid()
        return self._cache

    def _made(self) -> diskcache.Cache | None:
        """The tier's index opened for this process (its sweep done when due), or None
        with a warning where the tier cannot be used."""
        fstype = network_fs_type(self.directory)
        if fstype:
            self._warn(
                "disabled: the directory is on a network file system "
                f"({fstype}); SQLite locking is unsafe there, use local disk or tmpfs",
                fstype,
            )
            return None
        unsafe = refusal(self.directory, self.gid)
        if unsafe:
            self._warn("refused", unsafe)
            return None
        try:
            cache = diskcache.Cache(
                self.directory,
                disk=TierDisk,
                size_limit=2**62,
                cull_limit=0,
                eviction_policy="least-recently-stored",
                disk_min_file_size=0,
                statistics=0,
                sqlite_wal_autocheckpoint=64,
                sqlite_mmap_size=0,
                sqlite_cache_size=256,
            )
        except Exception as e:  # read-only, missing or full directory: run without the tier
            self._warn("cannot be opened", e)
            return None
        # the SSD tier's large values go around the page cache (zstore.cache._direct)
        cache.disk.direct = self.name == "ssd"
        for name in ("cache.db", "cache.db-wal", "cache.db-shm"):
            fix_file(os.path.join(self.directory, name))
        if self.record:
            upkeep.record_budget(self.directory, self.budget)
        try:
            upkeep.sweep_if_due(cache, self.directory)
        except Exception as e:
            self._warn("sweeping leftover files failed", e)
        return cache

    def recorded_budget(self) -> int | None:
        """The budget the processes using this tier last ran with (None: not known)."""
        return upkeep.recorded_budget(self.directory)

    def sweep(self, min_age: float = 60.0) -> int:
        """Remove value files no index row refers to (left by killed writers)."""
        return upkeep.sweep(self._open(), self.directory, min_age)

    def usage(self) -> dict[str, Any]:
        """Bytes the tier occupies on disk (values, index, WAL) and its entry count."""
        cache = self._open()
        recorded = self.recorded_budget()
        return {
            "bytes_on_disk": upkeep.bytes_on_disk(self.directory),
            "entries": len(cache) if cache is not None else 0,
            "budget": recorded if recorded is not None else self.budget,
            "budget_of": "the job" if recorded is not None else "these settings",
            "directory": self.directory,
            "ownership": describe(self.directory),
        }

    def clear(self) -> None:
        cache = self._open()
        if cache is not None:
            cache.clear(retry=True)
            self.sweep(min_age=0)
            self.evictions.forget_all()
