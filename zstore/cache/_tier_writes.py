"""The write side of :class:`zstore.cache.tier.Tier`: admission (what may enter, and
whom it displaces: :mod:`zstore.cache._space`) and puts, each under the tier's byte
budget, evicting before it inserts, in the index's transaction."""

from __future__ import annotations

import os
from collections.abc import Sequence

import diskcache
import numpy as np

from zstore.cache._space import Refused, rounded
from zstore.cache._tier_files import TierDisk, Written
from zstore.cache._tier_parts import TierPart
from zstore.cache.files import open_file
from zstore.cache.value import HEADER_SIZE, Parts, header, slotted_header

#: A value's file is written before the index's write transaction when the tier's free
#: room holds this many values of its size; nearer the budget, inside it (after the
#: evictions that make room, so the tier never holds more than its budget).  Inside,
#: the node's writers take the index in turn for a whole file write each: with 4 ranks
#: one rank's SSD writes of 7 MB shards waited behind the others' for epochs (SQLite's
#: busy handler sleeps up to 100 ms between tries).  Each process writes one value at
#: a time per tier, so the room the margin keeps covers that many writers at once.
EARLY_MARGIN = 8


class TierWrites(TierPart):
    """Admitting and storing a tier's values (the part of :class:`zstore.cache.tier.Tier`
    that does)."""

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
        disk: TierDisk = cache.disk
        evicted: list[int] = []
        written: list[str] = []
        where: dict[str, str] = {}  # the file each key's value went to
        try:
            need = [rounded(len(head) + len(payload)) for _, payload, head in todo]
            early = self.room.has_room(cache, EARLY_MARGIN * sum(need))
            files: list[Written | Parts] = []
            for key, payload, head in todo:
                if early:  # the file first, outside the index's transaction
                    disk.last_path = None
                    stored = disk.store(Parts(head, payload), True, key=key)
                    path = os.path.join(disk._directory, stored[2])  # (size, mode, filename, _)
                    files.append(Written(stored, path))
                    written.append(path)
                    where[key] = path
                else:
                    files.append(Parts(head, payload))
                disk.last_path = None
            with cache._transact(retry=True) as (sql, cleanup):
                for (key, payload, head), value, n in zip(todo, files, need):
                    if isinstance(value, Written) and not os.path.exists(value.path):
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

    def reserve(self, key: str, nbytes: int) -> bool:
        """Index an empty slotted value of ``nbytes`` under ``key`` (a sparse file, its
        slots written in place later: :mod:`zstore.cache.slots`), evicting first as
        :meth:`put` does; its whole size counts against the budget from now on.  True
        when ``key`` holds a value afterwards: this one, or one another process indexed
        first (kept: its slots may be written already)."""
        cache = self._open()
        if cache is None:
            return False
        if not self.fits(nbytes):
            self.stats.add(f"{self.name}_bypassed")
            return False
        disk: TierDisk = cache.disk
        path = ""
        try:
            filename, path = disk.filename()
            disk.last_path = None
            fd = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                os.write(fd, slotted_header(nbytes))
                os.ftruncate(fd, HEADER_SIZE + nbytes)
            finally:
                os.close(fd)
            size = rounded(HEADER_SIZE + nbytes)
            stored = (size, diskcache.core.MODE_BINARY, filename, None)
            with cache._transact(retry=True) as (sql, cleanup):
                if sql("SELECT 1 FROM Cache WHERE key = ? AND raw = 1", (key,)).fetchone():
                    self._unlink([path])
                    return True
                evicted = self.room.make(cache, sql, cleanup, size, key)
                cache.set(key, Written(stored, path), read=True, retry=True)
            self.evictions.record(evicted)
        except Refused:  # admission keeps the resident values
            self._unlink([path])
            self.stats.add(f"{self.name}_rejected")
            return False
        except Exception as e:  # full tmpfs, deleted or read-only directory
            self._unlink([path] if path else [])
            self._warn("write failed", e)
            return False
        return True

    @staticmethod
    def _unlink(paths: list[str]) -> None:
        """Remove value files a rolled-back transaction wrote."""
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass
