"""Tier values a process maps read-only and keeps mapped: decoded or encoded shards in
the RAM tier, whole shard objects in the SSD tier.

A value is looked up in the tier once per process; after that a hit is one dict
lookup.  Every process follows the node's eviction log and drops its maps of
evicted files (on its next read, and from a daemon thread while idle), so their
pages are freed and node memory stays within the RAM budget.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from zstore.cache import Checked, Tier

MAX_MAPS = 4096  # values a process keeps mapped (vm.max_map_count is ~65k)
UNMAP_EVERY = 0.2  # seconds between an idle process's checks for evicted values


@dataclass
class Mapped:
    """One mapped value: ``view`` is what the form makes of it (an array, an index)."""

    view: Any
    checked: Checked
    path: str
    ino: int


class MappedValues:
    """The values of one tier that this process has mapped.

    ``lock`` guards the maps: readers hold it for a whole read, the unmapping thread
    while it drops maps.
    """

    def __init__(self, tier: Tier):
        self.tier = tier
        self.maps: OrderedDict[str, Mapped] = OrderedDict()
        self.evicted_seen = tier.evictions.head()
        self.lock = threading.Lock()
        _start_unmapper(self)

    def get(
        self,
        key: str,
        make_view: Callable[[Checked], Any],
        *,
        again: bool = False,
        counted: bool = True,
    ) -> Mapped | None:
        """The mapped value of ``key`` (mapping it on first use), or None when the tier
        lacks it or ``make_view`` rejects it (returns None).  ``again``: a recheck under
        a build lock, not counted as a miss; ``counted=False``: neither a hit nor a miss
        is counted, nor an access (the caller counts what it reads)."""
        entry = self.maps.get(key)
        if entry is not None:
            if self.tier.evictions.head() != self.evicted_seen:
                self.drop_evicted()
                return self.get(key, make_view, again=again, counted=counted)
            if counted:
                self.tier.stats.add(f"{self.tier.name}_hits")
                self.tier.touch(key)
            return entry
        got = self.tier.get_mapped(key, count_miss=counted and not again)
        if got is None:
            return None
        checked, path, ino = got
        view = make_view(checked)
        if view is None:  # the value does not fit its form: corrupt, drop it
            self.tier.drop(key, ino)
            return None
        entry = self.maps[key] = Mapped(view, checked, path, ino)
        if len(self.maps) > MAX_MAPS:
            self.maps.popitem(last=False)
        return entry

    def slotted(
        self,
        key: str,
        build: Callable[[memoryview], Any],
        *,
        reserve: Callable[[], int] | None = None,
        lock: Any = None,
    ) -> Any:
        """The view ``build`` makes of the slotted value of ``key`` from its payload
        (:mod:`zstore.cache.slots`; the view's ``slots`` get the file's path, for their
        writes), nothing counted; or None.  Where the tier lacks it and ``reserve`` is
        given, an empty value of ``reserve()`` bytes is indexed first, if the tier admits
        it (none when that is 0).  A value that is not slotted, or that ``build`` refuses (``ValueError``: of
        another size), is dropped as corrupt.  ``lock``: held around the lookups (not the
        reservation), for a caller that does not hold ``self.lock`` already."""
        view = partial(_slotted_view, build)
        with lock if lock is not None else contextlib.nullcontext():
            got = self.get(key, view, counted=False)
        if got is None:
            if reserve is None:
                return None
            nbytes = reserve()
            if (
                not nbytes
                or self.tier.admits_as(key, nbytes) is None
                or not self.tier.reserve(key, nbytes)
            ):
                return None
            with lock if lock is not None else contextlib.nullcontext():
                got = self.get(key, view, counted=False)
            if got is None:
                return None
        got.view.slots.path = got.path
        return got.view

    def get_many(self, wanted: list[tuple[str, Callable[[Checked], Any]]]) -> list[Mapped | None]:
        """:meth:`get` of each ``(key, make_view)``, counted the same (a hit each), with
        the eviction log checked and the hits added once for all (a batch of short
        windows looks up ~50 shards)."""
        if self.tier.evictions.head() != self.evicted_seen:
            self.drop_evicted()
        found = [self.maps.get(key) for key, _ in wanted]
        hit = [key for (key, _), entry in zip(wanted, found) if entry is not None]
        if hit:
            self.tier.touch_many(hit)
            self.tier.stats.add(f"{self.tier.name}_hits", len(hit))
        return [  # the rest as get() maps them (a miss counted, or a map made)
            entry if entry is not None else self.get(key, make_view)
            for (key, make_view), entry in zip(wanted, found)
        ]

    def absent(self, keys: list[str]) -> set[str]:
        """Those of ``keys`` neither mapped by this process nor in the tier now, found by
        one index query, each counted as :meth:`get` counts a miss (an access and a
        miss).  A batch's first touches of ~60 shards then cost one SQLite round, not
        one each (docs/benchmarks-notes.md, "The first batch of packed items").  A key
        another process puts in the tier just after is read as a miss would be: the
        caller's later checks under the node's lock find it."""
        return self.tier.lacks([key for key in keys if key not in self.maps], count_miss=True)

    def discard(self, key: str) -> None:
        """Unmap a value found corrupt and drop it from the tier, so it is rebuilt; the
        drop is logged where every process looks, so they unmap it too (they may have
        checked its blocks before the damage)."""
        entry = self.maps.pop(key, None)
        self.tier.drop(key, entry.ino if entry is not None else 0)

    def remove(self, key: str) -> None:
        """Unmap a value superseded by one of another form and remove it from the tier
        (:meth:`discard` for a value that is not corrupt)."""
        with self.lock:
            self.maps.pop(key, None)
        self.tier.remove(key)

    def drop_evicted(self) -> None:
        """Unmap values evicted by any process, so their tmpfs pages are freed."""
        self.evicted_seen, inodes = self.tier.evictions.since(self.evicted_seen)
        if inodes is None:  # more evictions than the log holds: check every map
            gone = [k for k, m in self.maps.items() if not _alive(m.path, m.ino)]
        else:
            evicted = set(inodes)
            gone = [k for k, m in self.maps.items() if m.ino in evicted]
        for key in gone:
            del self.maps[key]


def _start_unmapper(values: MappedValues) -> None:
    """A daemon thread that drops the maps of values other processes evicted, so an idle
    process (a worker between epochs) does not keep their tmpfs pages alive."""
    ref = weakref.ref(values)
    pid = os.getpid()

    def loop() -> None:
        while True:
            time.sleep(UNMAP_EVERY)
            current = ref()
            if current is None or os.getpid() != pid:
                return
            if current.tier.evictions.head() != current.evicted_seen:
                with current.lock:
                    current.drop_evicted()
            del current

    threading.Thread(target=loop, name="zstore-unmap", daemon=True).start()


def _slotted_view(build: Callable[[memoryview], Any], checked: Checked) -> Any:
    """``build``'s view of a mapped slotted value; None when it is not one."""
    if not checked.slotted:
        return None
    try:
        return build(checked.payload)
    except ValueError:
        return None


def _alive(path: str, ino: int) -> bool:
    try:
        return os.stat(path).st_ino == ino
    except OSError:
        return False
