"""One cache tier: a directory shared by every process on the node, with a byte budget.

The engine is :mod:`diskcache` (SQLite index + one file per value), which gives
process-safe inserts and lookups.  On top of it this module adds what diskcache
lacks: a header with length and crc32c on every value (checked on read; a bad
value is dropped and reported as a miss), a hard byte budget that counts the
index files (eviction runs *before* an insert, in the same transaction), page
rounding of sizes, a sweep of files left by killed writers, and graceful
degradation: any failure of the tier warns once and reads fall through.

Who gives way in a full tier is :mod:`zstore.cache._space`; where a tier may live,
:mod:`zstore.cache._location`; the directory's upkeep, :mod:`zstore.cache._upkeep`.
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import diskcache
import numpy as np

import zstore.cache._upkeep as upkeep
from zstore.cache._direct import DIRECT_MIN, write_direct
from zstore.cache._evictions import EvictionLog
from zstore.cache._location import refusal
from zstore.cache._own import OwnWrites
from zstore.cache._space import Refused, Room, rounded
from zstore.cache._stats import Stats
from zstore.cache.files import fix_file
from zstore.cache.ownership import describe, make_dir
from zstore.cache.value import Checked, Parts, header, open_value
from zstore.urls import network_fs_type


class _Disk(diskcache.Disk):
    """diskcache's Disk with page-rounded sizes, one level of 256 subdirectories, and
    the tier's modes on what it creates (see :mod:`zstore.cache.ownership`).

    ``last_path`` (the file the calling thread created last) is per thread: a process's
    reads, RAM fills and SSD writes write value files at once, outside the index's lock
    (one shared attribute gave a thread another's path, or None)."""

    _made: set[str] | None = None
    #: Write value files around the page cache (the SSD tier; see
    #: :mod:`zstore.cache._direct`).
    direct = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._thread = threading.local()

    @property
    def last_path(self) -> str | None:
        return getattr(self._thread, "path", None)

    @last_path.setter
    def last_path(self, path: str | None) -> None:
        self._thread.path = path

    def filename(
        self, key: Any = diskcache.core.UNKNOWN, value: Any = diskcache.core.UNKNOWN
    ) -> tuple[str, str]:
        name = os.urandom(16).hex()
        filename = os.path.join(name[:2], name[2:] + ".val")
        if self._made is None:
            self._made = set()
        if name[:2] not in self._made:  # 0700 (2770 shared), not the umask's 0755
            make_dir(os.path.join(self._directory, name[:2]))
            self._made.add(name[:2])
        self.last_path = os.path.join(self._directory, filename)
        return filename, self.last_path

    def _write(self, full_path: str, iterator: Any, mode: str, encoding: Any = None) -> int:
        """diskcache's file write; around the page cache where ``direct`` is set and
        the value is large (:mod:`zstore.cache._direct`)."""
        if self.direct and mode == "xb":
            parts = list(iterator)
            if sum(len(p) for p in parts) >= DIRECT_MIN:
                try:
                    written = write_direct(full_path, parts)
                except FileNotFoundError:  # its directory went: diskcache makes it again
                    written = None
                else:
                    if written is None:  # the file system refuses it: buffered from now on
                        self.direct = False
                if written is not None:
                    return written
            iterator = iter(parts)
        return int(super()._write(full_path, iterator, mode, encoding))

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN) -> Any:
        if isinstance(value, _Written):  # written before the index's transaction
            return value.stored
        size, mode, filename, db_value = super().store(value, read, key=key)
        if filename:
            fix_file(os.path.join(self._directory, filename))
        return rounded(size), mode, filename, db_value


class _Written:
    """A value file already written at ``path`` (what :meth:`_Disk.store` returned for
    it).  Until its index row is committed, a sweep may take it for a killed writer's
    file (after a minute): the insert then writes it again, under the index's lock."""

    def __init__(self, stored: Any, path: str):
        self.stored, self.path = stored, path


#: A value's file is written before the index's write transaction when the tier's free
#: room holds this many values of its size; nearer the budget, inside it (after the
#: evictions that make room, so the tier never holds more than its budget).  Inside,
#: the node's writers take the index in turn for a whole file write each: with 4 ranks
#: one rank's SSD writes of 7 MB shards waited behind the others' for epochs (SQLite's
#: busy handler sleeps up to 100 ms between tries).  Each process writes one value at
#: a time per tier, so the room the margin keeps covers that many writers at once.
EARLY_MARGIN = 8


class Tier:
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
        self._pid, self._cache, self._warned = os.getpid(), None, set()
        if self.own is not None:  # a forked child trusts what it writes, not its parent
            self.own = OwnWrites()
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
            self._cache = diskcache.Cache(
                self.directory,
                disk=_Disk,
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
            self._cache = None
            return None
        # the SSD tier's large values go around the page cache (zstore.cache._direct)
        self._cache.disk.direct = self.name == "ssd"
        for name in ("cache.db", "cache.db-wal", "cache.db-shm"):
            fix_file(os.path.join(self.directory, name))
        if self.record:
            upkeep.record_budget(self.directory, self.budget)
        try:
            upkeep.sweep_if_due(self._cache, self.directory)
        except Exception as e:
            self._warn("sweeping leftover files failed", e)
        return self._cache

    def recorded_budget(self) -> int | None:
        """The budget the processes using this tier last ran with (None: not known)."""
        return upkeep.recorded_budget(self.directory)

    def sweep(self, min_age: float = 60.0) -> int:
        """Remove value files no index row refers to (left by killed writers)."""
        return upkeep.sweep(self._cache, self.directory, min_age)

    def get(self, key: str, *, count_miss: bool = True) -> memoryview | None:
        """The payload for ``key``, or None (missing, failed its check, or tier down)."""
        found = self._lookup(key, count_miss=count_miss, mapped=False)
        return None if found is None else found[0].payload

    def get_many(
        self,
        keys: list[str],
        *,
        count_miss: bool = True,
        into: Callable[[int], memoryview | None] | None = None,
    ) -> list[memoryview | None]:
        """Payloads for ``keys`` (None where missing or bad): one index query for all of
        them, then one read per value -- a window's ~20 chunks cost one SQLite round.

        ``into(nbytes)`` gives a writable view to read a value of that size into (None:
        new memory), e.g. a reader's reused slabs (``zstore.buffers``): the payload is
        then a view of it."""
        cache = self._open()
        if cache is None or not keys:
            return [None] * len(keys)
        if count_miss:
            for key in keys:
                self.touch(key)
        files: dict[str, str] = {}
        try:
            for start in range(0, len(keys), 500):  # SQLite's bound-parameter limit
                part = keys[start : start + 500]
                rows = cache._sql(
                    "SELECT key, filename FROM Cache WHERE raw = 1 AND key IN (%s)"
                    % ",".join("?" * len(part)),
                    part,
                ).fetchall()
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
                    value = _read_value(os.path.join(self.directory, filename), into)
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

    def holds(self, key: str) -> bool:
        """Whether the tier holds ``key`` now (nothing counted, nothing read)."""
        cache = self._open()
        if cache is None:
            return False
        try:
            return key in cache
        except Exception as e:
            self._warn("lookup failed", e)
            return False

    def get_mapped(self, key: str, *, count_miss: bool = True) -> tuple[Checked, str, int] | None:
        """Map ``key``'s value read-only: (checked payload, file path, inode), or None.

        A blocked value's payload is checked lazily, by ``Checked.verify``, for the bytes
        the caller reads; call :meth:`drop` when that fails.
        """
        return self._lookup(key, count_miss=count_miss, mapped=True)

    def _lookup(
        self, key: str, *, count_miss: bool, mapped: bool
    ) -> tuple[Checked, str, int] | None:
        """Open ``key``'s value, read (or, ``mapped``, memory-mapped) and checked: whole
        when read, lazily for blocked values when mapped."""
        cache = self._open()
        if cache is None:
            return None
        if count_miss:  # a first lookup, not a recheck under a lock
            self.touch(key)
        ino, own = 0, False
        try:
            handle = cache.get(key, default=None, read=True)
            if handle is None:
                if count_miss:
                    self.stats.add(f"{self.name}_misses")
                return None
            with handle:
                if mapped:
                    st = os.fstat(handle.fileno())
                    value: Any = (
                        mmap.mmap(handle.fileno(), st.st_size, access=mmap.ACCESS_READ)
                        if st.st_size
                        else b""
                    )
                    ino = st.st_ino
                    own = self.own is not None and self.own.wrote(key, st)
                else:
                    value = handle.read()
        except Exception as e:
            self._warn("read failed", e)
            return None
        checked = open_value(value)
        if checked is None or not (mapped or checked.verify(0, len(checked.payload))):
            self._corrupt(cache, key, ino=ino)
            return None
        if own:  # written through this object: its blocks need no check (see _own)
            checked.complete = True
        self.stats.add(f"{self.name}_hits")
        self.stats.add(f"{self.name}_hit_bytes", len(checked.payload))
        return checked, handle.name, ino

    def drop(self, key: str, ino: int = 0) -> None:
        """Remove a value found corrupt by a lazy check, so it is rebuilt.  ``ino``: the
        inode of the damaged file as the caller mapped it; it is dropped only if it is
        still the value (another process may have rebuilt it already), and it is logged
        in the eviction ring either way, so every process unmaps it."""
        cache = self._open()
        if cache is None:
            return
        if ino and self._current_ino(cache, key) != ino:
            self.evictions.record([ino])
            return
        self._corrupt(cache, key, count_miss=False, ino=ino)

    def _current_ino(self, cache: diskcache.Cache, key: str) -> int:
        try:
            handle = cache.get(key, default=None, read=True)
            if handle is None:
                return 0
            with handle:
                return os.fstat(handle.fileno()).st_ino
        except Exception:
            return 0

    def _corrupt(
        self, cache: diskcache.Cache, key: str, *, count_miss: bool = True, ino: int = 0
    ) -> None:
        self.stats.add(f"{self.name}_corrupt")
        if count_miss:  # a value found bad on lookup is a miss; one dropped later was a hit
            self.stats.add(f"{self.name}_misses")
        try:
            cache.delete(key, retry=True)
        except Exception as e:
            self._warn("dropping a corrupt value failed", e)
        if ino:  # processes that mapped it (and checked its blocks before) unmap it
            self.evictions.record([ino])
        return None

    def touch(self, key: str) -> None:
        """Count an access of ``key`` for admission (also for hits served from a map)."""
        if self.sketch is not None:
            self.sketch.touch(key)

    def touch_many(self, keys: list[str]) -> None:
        """:meth:`touch` of each of ``keys``."""
        if self.sketch is not None:
            self.sketch.touch_many(keys)

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
        values), or None (refused; see :mod:`zstore.cache._space`)."""
        if not self.fits(nbytes, blocked=blocked):
            return None
        cache = self._open()
        if cache is None:
            return None
        try:
            how = self.room.admits_as(cache, key, nbytes, blocked=blocked)
        except Exception as e:
            self._warn("read failed", e)
            return None
        if how is None:
            self.stats.add(f"{self.name}_rejected")
        return how

    def fits(self, nbytes: int, *, blocked: bool = False) -> bool:
        """Whether a value of ``nbytes`` can be stored at all (else it bypasses the tier)."""
        return self.room.fits(nbytes, blocked=blocked)

    def put(
        self, key: str, payload: bytes | memoryview | np.ndarray, *, blocked: bool = False
    ) -> bool:
        """Store ``payload`` under ``key``, evicting the oldest values first to stay in budget.

        ``blocked`` stores a crc32c per 128 KiB block, for values mapped and read in parts.
        """
        return self.put_many([(key, payload)], blocked=blocked) == 1

    def put_many(
        self,
        values: Sequence[tuple[str, bytes | memoryview | np.ndarray]],
        *,
        blocked: bool = False,
    ) -> int:
        """Store each (key, payload) of ``values`` as :meth:`put` does, in one index
        transaction (a first epoch puts a shard index per shard it touches: one
        transaction each was a tenth of its first batch); how many were stored.  When
        admission refuses one, the others are stored one by one."""
        cache = self._open()
        if cache is None:
            return 0
        todo: list[tuple[str, memoryview | bytes, bytes]] = []
        for key, payload in values:
            if isinstance(payload, np.ndarray):
                payload = np.ascontiguousarray(payload).data.cast("B")
            if not self.fits(len(payload), blocked=blocked):
                self.stats.add(f"{self.name}_bypassed")
                continue
            todo.append((key, payload, header(payload, blocked=blocked)))
        if not todo:
            return 0
        disk: _Disk = cache.disk
        evicted: list[int] = []
        written: list[str] = []
        where: dict[str, str] = {}  # the file each key's value went to
        try:
            need = [rounded(len(head) + len(payload)) for _, payload, head in todo]
            early = self.room.has_room(cache, EARLY_MARGIN * sum(need))
            files: list[_Written | Parts] = []
            for key, payload, head in todo:
                if early:  # the file first, outside the index's transaction
                    disk.last_path = None
                    stored = disk.store(Parts(head, payload), True, key=key)
                    path = os.path.join(disk._directory, stored[2])  # (size, mode, filename, _)
                    files.append(_Written(stored, path))
                    written.append(path)
                    where[key] = path
                else:
                    files.append(Parts(head, payload))
                disk.last_path = None
            with cache._transact(retry=True) as (sql, cleanup):
                for (key, payload, head), value, n in zip(todo, files, need):
                    if isinstance(value, _Written) and not os.path.exists(value.path):
                        value = Parts(head, payload)  # swept while it waited: write it now
                    evicted += self.room.make(cache, sql, cleanup, n, key)
                    disk.last_path = None
                    cache.set(key, value, read=True, retry=True)
                    if disk.last_path:
                        written.append(disk.last_path)
                        where[key] = disk.last_path
                    disk.last_path = None
            # Logged once committed and unlinked, not before: a reader whose snapshot
            # predates the commit may still open an evicted file until it is unlinked,
            # and it must see that file's inode in the log after it has mapped it.
            self.evictions.record(evicted)
        except Refused:  # admission keeps the resident values
            self._unlink(written)
            if len(todo) > 1:
                return sum(self.put(key, payload, blocked=blocked) for key, payload, _ in todo)
            self.stats.add(f"{self.name}_rejected")
            return 0
        except Exception as e:  # full disk, deleted or read-only directory
            self._unlink(written + ([disk.last_path] if disk.last_path else []))
            disk.last_path = None
            self._warn("write failed", e)
            return 0
        if self.own is not None:
            for key, path in where.items():
                self.own.record(key, path)
        self.stats.add(f"{self.name}_fills", len(todo))
        self.stats.add(
            f"{self.name}_fill_bytes", sum(len(head) + len(payload) for _, payload, head in todo)
        )
        return len(todo)

    @staticmethod
    def _unlink(paths: list[str]) -> None:
        """Remove value files a rolled-back transaction wrote."""
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass

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


def _read_value(path: str, into: Callable[[int], memoryview | None] | None) -> Any:
    """The bytes of the value file at ``path``, read into ``into(size)`` when it gives
    a view (each chunk value read into new bytes page-faulted fresh memory: ~85,000
    pages an epoch of SSD-tier hits, docs/benchmarks-notes.md)."""
    with open(path, "rb", buffering=0) as f:
        view = into(os.fstat(f.fileno()).st_size) if into is not None else None
        if view is None:
            return f.readall()
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:  # shorter than its size said: open_value refuses it
                break
            got += n
        return view[:got]
