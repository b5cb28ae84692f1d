"""The read side of :class:`zstore.cache.tier.Tier`: lookups, reads and maps of values,
each checked (length, crc32c) before it is served; a value that fails is dropped and
counted as a miss; and the accesses admission counts."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from typing import Any

import diskcache

from zstore.cache._tier_parts import TierPart
from zstore.cache.value import Checked, open_value


class TierReads(TierPart):
    """Reading a tier's values (the part of :class:`zstore.cache.tier.Tier` that does)."""

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
        try:
            files = {k: f for k, f in _filenames(cache, keys).items() if f}
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
                    value = read_value(os.path.join(self.directory, filename), into)
                except OSError:  # evicted since the query: a miss
                    value = None
            checked = open_value(value) if value is not None else None
            if checked is not None and checked.slotted:  # read in place only (slots)
                value = checked = None
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

    def lacks(self, keys: list[str], *, count_miss: bool = False) -> set[str]:
        """Those of ``keys`` the tier does not hold now: one index query for all of them,
        nothing read; ``count_miss``: each key returned counted as :meth:`get_many` counts
        a miss (an access and a miss).  Empty when the tier is down or the query fails:
        the caller then looks each key up as before."""
        if not keys:  # a warm batch: every shard mapped, nothing to ask
            return set()
        cache = self._open()
        if cache is None:
            return set()
        try:
            lacking = set(keys) - _filenames(cache, keys).keys()
        except Exception as e:
            self._warn("lookup failed", e)
            return set()
        if count_miss and lacking:
            self.touch_many(list(lacking))
            self.stats.add(f"{self.name}_misses", len(lacking))
        return lacking

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
        if checked is not None and checked.slotted and not mapped:  # read in place only
            if count_miss:
                self.stats.add(f"{self.name}_misses")
            return None
        if checked is None or not (mapped or checked.verify(0, len(checked.payload))):
            self._corrupt(cache, key, ino=ino)
            return None
        if own:  # written through this object: its blocks need no check (see _own)
            checked.complete = True
        if not checked.slotted:  # a slotted value's reader counts the slots it reads
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

    def remove(self, key: str, *, mapped: bool = True) -> None:
        """Remove ``key``'s value, superseded by a value of another form (``zstore cache
        warm`` keeps a shard whole that the tier held as slots or chunk values); logged
        in the eviction ring, so every process unmaps it, unless not ``mapped`` (a kind
        of value processes read, never map: a chunk's, a shard index's)."""
        cache = self._open()
        if cache is None:
            return
        ino = self._current_ino(cache, key) if mapped else 0
        if self._delete(cache, key, "removing a value") and ino:
            self.evictions.record([ino])

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
        self._delete(cache, key, "dropping a corrupt value")
        if ino:  # processes that mapped it (and checked its blocks before) unmap it
            self.evictions.record([ino])
        return None

    def _delete(self, cache: diskcache.Cache, key: str, what: str) -> bool:
        """Delete ``key`` from the index (its file goes with it); False, with a warning
        naming ``what``, when that fails."""
        try:
            cache.delete(key, retry=True)
        except Exception as e:
            self._warn(f"{what} failed", e)
            return False
        return True

    def touch(self, key: str) -> None:
        """Count an access of ``key`` for admission (also for hits served from a map)."""
        if self.sketch is not None:
            self.sketch.touch(key)

    def touch_many(self, keys: list[str]) -> None:
        """:meth:`touch` of each of ``keys``."""
        if self.sketch is not None:
            self.sketch.touch_many(keys)


def _filenames(cache: diskcache.Cache, keys: list[str]) -> dict[str, str | None]:
    """The value file of each of ``keys`` the tier's index holds (None: a value kept in
    the index itself), by one query per 500 keys (SQLite's bound-parameter limit)."""
    files: dict[str, str | None] = {}
    for start in range(0, len(keys), 500):
        part = keys[start : start + 500]
        rows = cache._sql(
            "SELECT key, filename FROM Cache WHERE raw = 1 AND key IN (%s)"
            % ",".join("?" * len(part)),
            part,
        ).fetchall()
        files.update(rows)
    return files


def read_value(path: str, into: Callable[[int], memoryview | None] | None) -> Any:
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
