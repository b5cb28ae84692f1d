"""One cache tier: a directory shared by every process on the node, with a byte budget.

The engine is :mod:`diskcache` (SQLite index + one file per value), which gives
process-safe inserts and lookups.  On top of it this module adds what diskcache
lacks: a header with length and crc32c on every value (checked on read; a bad
value is dropped and reported as a miss), a hard byte budget that counts the
index files (eviction runs *before* an insert, in the same transaction), page
rounding of sizes, a sweep of files left by killed writers, and graceful
degradation: any failure of the tier warns once and reads fall through.
"""

from __future__ import annotations

import json
import mmap
import os
import time
import warnings
from typing import Any

import diskcache
import numpy as np

from zstore.cache.admission import FrequencySketch, admit, sketch_bytes, sketch_width
from zstore.cache.evictions import EvictionLog
from zstore.cache.ownership import (describe, fix_file, make_dir, open_file, problem,
                                    write_json)
from zstore.cache.stats import Stats
from zstore.cache.value import Checked, Parts, header, header_size, open_value

PAGE = 4096
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph",
              "fuse.sshfs", "9p", "afs", "glusterfs", "fuse.glusterfs")


#: Directories zstore keeps in a tier directory (the first tier's: see tiers.node_dir).
NODE_SUBDIRS = ("stats", "locks", "formats", "fsspec-info", "layouts")
BUDGET_FILE = "budget.json"
REFUSAL_FRESH = 1.0  # seconds a process trusts its last look at a full tier's oldest values


def refusal(directory: str, gid: int | None) -> str | None:
    """Why a tier must not use ``directory`` (creating it if missing), else None: it and
    the directories zstore keeps in it must be writable by this user only (or, opted in,
    by one group)."""
    why = make_dir(directory, gid)
    for sub in NODE_SUBDIRS if why is None else ():
        path = os.path.join(directory, sub)
        why = problem(path, gid) if os.path.lexists(path) else None
        if why is not None:
            directory = path
            break
    if why is None:
        return None
    return (f"{directory} {why} ({describe(directory)}); a directory others can write "
            "could feed planted values to training. Use a directory of your own "
            "(chmod 700), or opt in to sharing with a group (shared_group=)")


def rounded(n: int) -> int:
    return -(-n // PAGE) * PAGE


def filesystem_type(path: str) -> str:
    """The type of the file system that holds ``path`` (from /proc/mounts)."""
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (path == parts[1] or path.startswith(
                        parts[1].rstrip("/") + "/")) and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def network_fs_type(path: str) -> str | None:
    """The file system type of ``path`` when it is a network one (NFS, Lustre, ...), else None."""
    kind = filesystem_type(os.path.abspath(path))
    return kind if kind in NETWORK_FS else None


class _Refused(Exception):
    """Admission refused a value (internal: aborts the insert's transaction)."""


class _Disk(diskcache.Disk):
    """diskcache's Disk with page-rounded sizes, one level of 256 subdirectories, and
    the tier's modes on what it creates (see :mod:`zstore.cache.ownership`)."""

    last_path: str | None = None
    _made: set[str] | None = None

    def filename(self, key: Any = diskcache.core.UNKNOWN,
                 value: Any = diskcache.core.UNKNOWN) -> tuple[str, str]:
        name = os.urandom(16).hex()
        filename = os.path.join(name[:2], name[2:] + ".val")
        if self._made is None:
            self._made = set()
        if name[:2] not in self._made:  # 0700 (2770 shared), not the umask's 0755
            make_dir(os.path.join(self._directory, name[:2]))
            self._made.add(name[:2])
        self.last_path = os.path.join(self._directory, filename)
        return filename, self.last_path

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN) -> Any:
        size, mode, filename, db_value = super().store(value, read, key=key)
        if filename:
            fix_file(os.path.join(self._directory, filename))
        return rounded(size), mode, filename, db_value


class Tier:
    """A byte-budgeted, node-shared key -> bytes tier in ``directory``.

    ``get``/``put`` move packed values; ``get_mapped`` maps a value read-only and
    returns a zero-copy view of its payload.  Safe across processes and forks
    (connections are reopened in a new process), pickles as its settings.
    """

    def __init__(self, name: str, directory: str, budget: int, stats: Stats,
                 admission: bool = False, gid: int | None = None, record: bool = False):
        self.name = name
        self.record = record  # write the budget where `zstore cache stats` finds it
        self.gid = gid  # shared with this group (opt-in), else private to this user
        self.directory = directory
        self.budget = int(budget)
        self.reserve = min(2 * 2**20, self.budget // 4)  # SQLite WAL, -shm, directories
        self.stats = stats
        self.admission = admission
        self.sketch = None
        self._refusal_floor: tuple[int, float] | None = None  # see admits()
        if admission:
            width = sketch_width(self.budget)
            self.sketch = FrequencySketch(directory, width)
            self.reserve += rounded(sketch_bytes(width))
        self.evictions = EvictionLog(directory)
        self._pid = -1
        self._cache: diskcache.Cache | None = None
        self._warned: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "directory": self.directory, "budget": self.budget,
                "stats": self.stats, "admission": self.admission, "gid": self.gid,
                "record": self.record}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def _warn(self, what: str, exc: BaseException | str) -> None:
        self.stats.add(f"{self.name}_errors")
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(f"zstore {self.name} tier at {self.directory}: {what} ({exc}); "
                          "reading through to the next tier or the origin", stacklevel=3)

    def _open(self) -> diskcache.Cache | None:
        if self._pid == os.getpid():
            return self._cache
        self._pid, self._cache, self._warned = os.getpid(), None, set()
        fstype = network_fs_type(self.directory)
        if fstype:
            self._warn("disabled: the directory is on a network file system "
                       f"({fstype}); SQLite locking is unsafe there, use local disk or tmpfs",
                       fstype)
            return None
        unsafe = refusal(self.directory, self.gid)
        if unsafe:
            self._warn("refused", unsafe)
            return None
        try:
            self._cache = diskcache.Cache(
                self.directory, disk=_Disk, size_limit=2**62, cull_limit=0,
                eviction_policy="least-recently-stored", disk_min_file_size=0,
                statistics=0, sqlite_wal_autocheckpoint=64, sqlite_mmap_size=0,
                sqlite_cache_size=256)
        except Exception as e:  # read-only, missing or full directory: run without the tier
            self._warn("cannot be opened", e)
            self._cache = None
            return None
        for name in ("cache.db", "cache.db-wal", "cache.db-shm"):
            fix_file(os.path.join(self.directory, name))
        if self.record:
            self._record_budget()
        self._sweep_if_due()
        return self._cache

    def _record_budget(self) -> None:
        path = os.path.join(self.directory, BUDGET_FILE)
        try:
            with open(path) as f:
                if json.load(f).get("budget") == self.budget:
                    return
        except (OSError, ValueError):
            pass
        write_json(path, {"budget": self.budget})

    def recorded_budget(self) -> int | None:
        """The budget the processes using this tier last ran with (None: not known)."""
        try:
            with open(os.path.join(self.directory, BUDGET_FILE)) as f:
                return int(json.load(f)["budget"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _sweep_if_due(self, every: float = 600.0) -> None:
        mark = os.path.join(self.directory, "swept")
        try:
            if time.time() - os.stat(mark).st_mtime < every:
                return
        except FileNotFoundError:
            pass
        try:
            os.close(open_file(mark, os.O_WRONLY | os.O_CREAT))
            os.utime(mark)
            self.sweep()
        except Exception as e:
            self._warn("sweeping leftover files failed", e)

    def sweep(self, min_age: float = 60.0) -> int:
        """Remove value files no index row refers to (left by killed writers)."""
        cache = self._cache
        if cache is None:
            return 0
        known = {row[0] for row in cache._sql("SELECT filename FROM Cache").fetchall()}
        now, removed = time.time(), 0
        for sub in os.listdir(self.directory):
            subdir = os.path.join(self.directory, sub)
            if len(sub) != 2 or not os.path.isdir(subdir):
                continue
            for name in os.listdir(subdir):
                rel, full = os.path.join(sub, name), os.path.join(subdir, name)
                try:
                    if rel not in known and now - os.stat(full).st_mtime > min_age:
                        os.unlink(full)
                        removed += 1
                except FileNotFoundError:
                    pass
        return removed

    def get(self, key: str, *, count_miss: bool = True) -> memoryview | None:
        """The payload for ``key``, or None (missing, failed its check, or tier down)."""
        found = self._lookup(key, count_miss=count_miss, mapped=False)
        return None if found is None else found[0].payload

    def get_many(self, keys: list[str], *, count_miss: bool = True
                 ) -> list[memoryview | None]:
        """Payloads for ``keys`` (None where missing or bad): one index query for all of
        them, then one read per value -- a window's ~20 chunks cost one SQLite round."""
        cache = self._open()
        if cache is None or not keys:
            return [None] * len(keys)
        if count_miss:
            for key in keys:
                self.touch(key)
        files: dict[str, str] = {}
        try:
            for start in range(0, len(keys), 500):  # SQLite's bound-parameter limit
                part = keys[start:start + 500]
                rows = cache._sql(
                    "SELECT key, filename FROM Cache WHERE raw = 1 AND key IN (%s)"
                    % ",".join("?" * len(part)), part).fetchall()
                files.update({k: f for k, f in rows if f})
        except Exception as e:
            self._warn("read failed", e)
            return [None] * len(keys)
        out: list[memoryview | None] = []
        hits = hit_bytes = misses = 0
        for key in keys:
            filename = files.get(key)
            value = None
            if filename is not None:
                try:
                    with open(os.path.join(self.directory, filename), "rb") as f:
                        value = f.read()
                except OSError:  # evicted since the query: a miss
                    value = None
            checked = open_value(value) if value is not None else None
            if checked is not None and not checked.verify(0, len(checked.payload)):
                checked = None
            if value is not None and checked is None:
                self._corrupt(cache, key, count_miss=False)
            if checked is None:
                misses += 1
                out.append(None)
            else:
                hits += 1
                hit_bytes += len(checked.payload)
                out.append(checked.payload)
        if count_miss and misses:
            self.stats.add(f"{self.name}_misses", misses)
        if hits:
            self.stats.add(f"{self.name}_hits", hits)
            self.stats.add(f"{self.name}_hit_bytes", hit_bytes)
        return out

    def get_mapped(self, key: str, *, count_miss: bool = True
                   ) -> tuple[Checked, str, int] | None:
        """Map ``key``'s value read-only: (checked payload, file path, inode), or None.

        A blocked value's payload is checked lazily, by ``Checked.verify``, for the bytes
        the caller reads; call :meth:`drop` when that fails.
        """
        return self._lookup(key, count_miss=count_miss, mapped=True)

    def _lookup(self, key: str, *, count_miss: bool, mapped: bool
                ) -> tuple[Checked, str, int] | None:
        """Open ``key``'s value, read (or, ``mapped``, memory-mapped) and checked: whole
        when read, lazily for blocked values when mapped."""
        cache = self._open()
        if cache is None:
            return None
        if count_miss:  # a first lookup, not a recheck under a lock
            self.touch(key)
        ino = 0
        try:
            handle = cache.get(key, default=None, read=True)
            if handle is None:
                if count_miss:
                    self.stats.add(f"{self.name}_misses")
                return None
            with handle:
                if mapped:
                    st = os.fstat(handle.fileno())
                    value: Any = mmap.mmap(handle.fileno(), st.st_size,
                                           access=mmap.ACCESS_READ) if st.st_size else b""
                    ino = st.st_ino
                else:
                    value = handle.read()
        except Exception as e:
            self._warn("read failed", e)
            return None
        checked = open_value(value)
        if checked is None or not (mapped or checked.verify(0, len(checked.payload))):
            return self._corrupt(cache, key)
        self.stats.add(f"{self.name}_hits")
        self.stats.add(f"{self.name}_hit_bytes", len(checked.payload))
        return checked, handle.name, ino

    def drop(self, key: str) -> None:
        """Remove a value found corrupt by a lazy check, so it is rebuilt."""
        cache = self._open()
        if cache is not None:
            self._corrupt(cache, key, count_miss=False)

    def _corrupt(self, cache: diskcache.Cache, key: str, *, count_miss: bool = True) -> None:
        self.stats.add(f"{self.name}_corrupt")
        if count_miss:  # a value found bad on lookup is a miss; one dropped later was a hit
            self.stats.add(f"{self.name}_misses")
        try:
            cache.delete(key, retry=True)
        except Exception as e:
            self._warn("dropping a corrupt value failed", e)
        return None

    def touch(self, key: str) -> None:
        """Count an access of ``key`` for admission (also for hits served from a map)."""
        if self.sketch is not None:
            self.sketch.touch(key)

    def set_period(self, accesses: int) -> None:
        """How many accesses the admission counts last before they are halved."""
        if self.sketch is not None and self._open() is not None:
            self.sketch.set_period(accesses)

    def admits(self, key: str, nbytes: int, *, blocked: bool = False) -> bool:
        """Whether :meth:`put` would store a value of ``nbytes`` under ``key`` now: it fits
        in the free room, or admission lets it displace resident values."""
        return self.admits_as(key, nbytes, blocked=blocked) is not None

    def admits_as(self, key: str, nbytes: int, *, blocked: bool = False) -> str | None:
        """How :meth:`put` would store a value of ``nbytes`` under ``key`` now: ``"room"``
        (it fits in the free room), ``"displace"`` (admission lets it displace resident
        values), or None (refused)."""
        if not self.fits(nbytes, blocked=blocked):
            return None
        cache = self._open()
        if cache is None:
            return None
        need = rounded(header_size(nbytes, blocked=blocked) + nbytes)
        # A full tier refuses most newcomers: while the last look at its oldest values
        # is fresh, a newcomer no more popular than they were is refused without
        # asking SQLite (under random access that is most misses of a window).
        floor = self._refusal_floor
        if self.sketch is not None and floor is not None and \
                time.monotonic() - floor[1] < REFUSAL_FRESH and \
                not admit(self.sketch.estimate(key), [floor[0]]):
            self.stats.add(f"{self.name}_rejected")
            return None
        try:
            victims = self._choose_victims(cache, cache._sql, key, need)
        except Exception as e:
            self._warn("read failed", e)
            return None
        if victims is None:
            self.stats.add(f"{self.name}_rejected")
            return None
        return "displace" if victims else "room"

    def fits(self, nbytes: int, *, blocked: bool = False) -> bool:
        """Whether a value of ``nbytes`` can be stored at all (else it bypasses the tier)."""
        return rounded(header_size(nbytes, blocked=blocked) + nbytes) + self.reserve \
            <= self.budget

    def put(self, key: str, payload: bytes | memoryview | np.ndarray, *,
            blocked: bool = False) -> bool:
        """Store ``payload`` under ``key``, evicting the oldest values first to stay in budget.

        ``blocked`` stores a crc32c per 128 KiB block, for values mapped and read in parts.
        """
        cache = self._open()
        if cache is None:
            return False
        if isinstance(payload, np.ndarray):
            payload = memoryview(np.ascontiguousarray(payload)).cast("B")
        if not self.fits(len(payload), blocked=blocked):
            self.stats.add(f"{self.name}_bypassed")
            return False
        head = header(payload, blocked=blocked)
        need = rounded(len(head) + len(payload))
        disk: _Disk = cache.disk
        evicted: list[int] = []
        try:
            with cache._transact(retry=True) as (sql, cleanup):
                evicted = self._make_room(cache, sql, cleanup, need, key)
                cache.set(key, Parts(head, payload), read=True, retry=True)
            # Logged once committed and unlinked, not before: a reader whose snapshot
            # predates the commit may still open an evicted file until it is unlinked,
            # and it must see that file's inode in the log after it has mapped it.
            self.evictions.record(evicted)
        except _Refused:  # admission keeps the resident values
            self.stats.add(f"{self.name}_rejected")
            return False
        except Exception as e:  # full disk, deleted or read-only directory
            if disk.last_path:
                try:
                    os.unlink(disk.last_path)
                except OSError:
                    pass
            self._warn("write failed", e)
            return False
        self.stats.add(f"{self.name}_fills")
        self.stats.add(f"{self.name}_fill_bytes", len(head) + len(payload))
        return True

    def _choose_victims(self, cache: diskcache.Cache, sql: Any, key: str, need: int
                        ) -> list[tuple[int, str]] | None:
        """The values to evict so that ``need`` more bytes fit (oldest stored first), or
        None when admission refuses (the newcomer is not clearly used more than they are)."""
        excess = cache.volume() + need - (self.budget - self.reserve)
        if excess <= 0:
            return []
        rows = sql("SELECT rowid, filename, size, key FROM Cache ORDER BY store_time LIMIT 64"
                   ).fetchall()
        victims, counts = [], []
        for rowid, filename, size, victim in rows:
            victims.append((rowid, filename))
            excess -= size
            if self.sketch is not None:
                counts.append(self.sketch.estimate(victim))
            if excess <= 0:
                break
        if self.sketch is not None and not admit(self.sketch.estimate(key), counts):
            self._refusal_floor = (min(counts, default=0), time.monotonic())
            return None
        self._refusal_floor = None
        return victims

    def _make_room(self, cache: diskcache.Cache, sql: Any, cleanup: Any, need: int,
                   key: str) -> list[int]:
        """Delete values until ``need`` more bytes fit; their inodes.  Raises
        :class:`_Refused` when admission keeps the resident values."""
        limit = self.budget - self.reserve
        excess = cache.volume() + need - limit
        inodes: list[int] = []
        while excess > 0:
            victims = self._choose_victims(cache, sql, key, need)
            if victims is None:
                raise _Refused  # rolls back what this transaction deleted so far
            if not victims:
                break
            sql("DELETE FROM Cache WHERE rowid IN (%s)" % ",".join(str(r) for r, _ in victims))
            for _, filename in victims:
                try:
                    inodes.append(os.stat(os.path.join(self.directory, filename)).st_ino)
                except OSError:
                    pass
                cleanup(filename)
            self.stats.add(f"{self.name}_evictions", len(victims))
            excess = cache.volume() + need - limit
        return inodes

    def usage(self) -> dict[str, int]:
        """Bytes the tier occupies on disk (values, index, WAL) and its entry count."""
        used = 0
        for dirpath, _, files in os.walk(self.directory):
            for f in files:
                try:
                    used += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
                except FileNotFoundError:
                    pass
        cache = self._open()
        entries = len(cache) if cache is not None else 0
        recorded = self.recorded_budget()
        return {"bytes_on_disk": used, "entries": entries,
                "budget": recorded if recorded is not None else self.budget,
                "budget_of": "the job" if recorded is not None else "these settings",
                "directory": self.directory, "ownership": describe(self.directory)}

    def clear(self) -> None:
        cache = self._open()
        if cache is not None:
            cache.clear(retry=True)
            self.sweep(min_age=0)
            self.evictions.forget_all()
