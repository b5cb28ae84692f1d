"""Shard objects at hand whole for a read: mapped from the SSD tier, or fetched whole now.

With ``fetch="shard"`` (by default, a remote store with a round trip of 5 ms or more
and an SSD tier that holds it: :mod:`zstore.read._fetch_mode`) the first touch of a shard reads the object whole, once for the node: the
process that takes the node's fill lock for it fetches it, and the others read their
windows' ranges around it instead of waiting.  :meth:`WholeFetch.find` sorts a read's
shards into those three kinds.  The whole fetches run in a thread of their own while
the reading thread fetches the shard indexes and ranges around the others: one origin
round for both, not one after the other (4 ranks on the S3-like origin: the first
batch spent ~170-310 ms fetching shards whole and then ~110-230 ms more on the ranges
around the other ranks' shards; docs/benchmarks-notes.md).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import numpy as np

from zstore.errors import MissingDataError
from zstore.format import EMPTY, ArrayLayout, decode_index
from zstore.origin import Request
from zstore.read._ssd_shards import Held, Wanted, WholeShards
from zstore.read._ssd_slots import SlottedShards
from zstore.read._warm_slots import RangeValues, whole_from_slots


class Pending:
    """Shard objects being fetched whole in a thread of their own."""

    def __init__(self, objs: list[str], fetch: Callable[[], dict[str, Held]]):
        self.objs = set(objs)
        self._got: dict[str, Held] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fetch,), name="zstore-whole")
        self._thread.start()

    def _run(self, fetch: Callable[[], dict[str, Held]]) -> None:
        try:
            self._got = fetch()
        except BaseException as e:  # raised in the reading thread, by result()
            self._error = e

    def result(self) -> dict[str, Held]:
        """The objects fetched (waits for the fetch; raises what it raised)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._got


class WholeFetch:
    """Whole shard objects for one process's reads of one store."""

    def __init__(
        self,
        whole: WholeShards,
        read: Callable[[list[Request]], list[bytes | memoryview | None]],
        missing: Callable[[str, str], MissingDataError],
        complete: bool,
    ):
        self.whole, self.read, self.missing, self.complete = whole, read, missing, complete

    def find(
        self, need: list[tuple[ArrayLayout, int]], *, fetch: bool
    ) -> tuple[dict[str, Held], set[str], Pending | None]:
        """The shards of ``need`` mapped whole from the SSD tier; and, when ``fetch``
        (``fetch="shard"``), those another process is fetching whole now (their chunks
        are read by ranges, not waited for) and this process's fetch of the others,
        started in its own thread (None when there is nothing to fetch)."""
        wanted: Wanted = {}
        for layout, k in need:
            if layout.sharded:
                obj = layout.object_key(k // layout.chunks_per_shard)
                wanted.setdefault(obj, (layout, []))[1].append(k % layout.chunks_per_shard)
        held = self.whole.held_many(wanted)
        todo = {obj: wanted[obj] for obj in wanted if obj not in held}
        if not todo or not fetch:
            return held, set(), None
        stack = contextlib.ExitStack()
        locks, busy = stack.enter_context(self.whole.first_free(list(todo)))
        if not locks:
            stack.close()
            return held, busy, None
        mine = {obj: todo[obj] for obj in locks}
        # the fetch's thread releases the locks no SSD write behind the reads took over
        return held, busy, Pending(list(mine), lambda: self._fetch_released(mine, locks, stack))

    def _fetch_released(
        self, todo: Wanted, locks: dict[str, list[int]], stack: contextlib.ExitStack
    ) -> dict[str, Held]:
        with stack:
            return self.fetch(todo, locks)

    def keep(self, layout: ArrayLayout, slotted: SlottedShards) -> None:
        """Put every shard of ``layout`` whole into the SSD tier (``zstore cache warm``),
        one at a time, waiting for another process's fetch of it; shards it holds
        already are left alone.  A shard a job's reads left in the tier in pieces (its
        slots, ``slotted``; or a value per chunk, ``fetch="range"``) is made whole from
        them and the ranges they lack, and the pieces are removed
        (:mod:`zstore.read._warm_slots`)."""
        if not layout.sharded:
            return
        for s in range(-(-layout.length // layout.shard)):
            obj = layout.object_key(s)
            if self.whole.held_many({obj: (layout, [])}):
                continue
            with self.whole.locked([obj]):
                if self.whole.held_many({obj: (layout, [])}, again=True):
                    continue
                shard = slotted.mapped(obj, layout)
                where = slotted.where(obj)
                data, pieces = None, None
                if shard is not None:
                    data = whole_from_slots(shard, obj, self.read, where)
                else:
                    pieces = RangeValues(self.whole.tiers, layout, obj, where)
                    data = pieces.whole(self.read)
                if data is not None:
                    self.whole.put(obj, memoryview(data))
                else:
                    self.fetch({obj: (layout, [])}, {})
                left = shard is not None or (pieces is not None and pieces.names)
                if left and self.whole.held_many({obj: (layout, [])}, again=True):
                    if pieces is not None:
                        pieces.remove()
                    else:
                        slotted.drop(obj)

    def fetch(self, todo: Wanted, locks: dict[str, list[int]]) -> dict[str, Held]:
        """Fetch shard objects whole (one concurrent origin round) into the SSD tier,
        holding the node's fill locks for them.  ``locks``: the objects whose SSD write
        may go behind the reads, which then releases its lock (taken out of ``locks``);
        the others are written here."""
        held = self.whole.held_many(todo, again=True)  # fetched elsewhere since looked up
        objs = [obj for obj in todo if obj not in held]
        for obj, data in zip(objs, self.read([(o, None, None) for o in objs])):
            layout = todo[obj][0]
            if data is None and self.complete:
                raise self.missing(obj, "shard")
            if data is None:  # a shard the store never wrote: all fill value
                index = np.full((layout.chunks_per_shard, 2), EMPTY, dtype=np.uint64)
                held[obj] = Held(index, b"")
                continue
            view = memoryview(data)
            index = decode_index(
                layout,
                view[len(view) - layout.index_bytes :],
                f"{self.whole.url}: {obj} (shard index)",
            )
            held[obj] = Held(index, view)
            # written behind the reads when there is room (it then owns the lock)
            if obj in locks and self.whole.put_behind(obj, held[obj], locks[obj]):
                del locks[obj]
            else:
                self.whole.put(obj, view)
        return held


def finish(pending: Pending | None, failing: bool = False) -> dict[str, Held]:
    """What ``pending`` fetched ({} for None).  ``failing``: the read is raising
    already; wait for the fetch (its locks released) but keep the read's error."""
    if pending is None:
        return {}
    if failing:
        with contextlib.suppress(BaseException):
            pending.result()
        return {}
    return pending.result()
