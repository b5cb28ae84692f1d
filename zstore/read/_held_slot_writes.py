"""The SSD slot writes of a fresh job's first reads, kept until the reader's hold on its
builds ends (:class:`zstore.read._builds.FirstReadHold`) and then written behind the
reads, instead of dropped.

The first reads write nothing into the tiers, so that the first batch costs what it
costs with no tiers (:mod:`zstore.read._ssd_slots`).  Their chunks used to be fetched
from the origin again when a later window read them: a quarter of one rank's first-epoch
requests to an S3 endpoint (docs/benchmarks-notes.md, "A chunk named twice in one
batch").  Their bytes are small (encoded) and already fetched: they are kept, up to
MAX_HELD_BYTES a process, and written by the SSD writes' thread once the hold ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from zstore.format import ArrayLayout
from zstore.read._builds import MAX_PENDING_BYTES, BehindBuilds

#: encoded bytes a process keeps for the slot writes its first reads held back (a
#: first batch of 16 windows of 10 s: ~25 MB); past it, a chunk is fetched again when
#: a later window reads it, as before
MAX_HELD_BYTES = MAX_PENDING_BYTES
#: the one queued job that writes them
KEY = "zstore-held-slot-writes"

#: (shard object, its layout, its index, chunk in shard, encoded bytes)
Held = tuple[str, ArrayLayout, np.ndarray, int, bytes]


class HeldWrites:
    """Slot writes held back by the first reads, written once ``hold`` starts its jobs;
    until each is written, a read takes its bytes from here (:meth:`get`)."""

    def __init__(
        self, hold: BehindBuilds, write: Callable[[str, ArrayLayout, np.ndarray, int, Any], None]
    ):
        self.hold, self.write = hold, write
        self._lock = threading.Lock()
        self._writes: dict[tuple[str, int], Held] = {}
        self._bytes = 0

    def add(
        self, obj: str, layout: ArrayLayout, index: np.ndarray, j: int, data: bytes | memoryview
    ) -> None:
        """Keep chunk ``j`` of ``obj`` (its bytes copied: they may lie in a reused read
        buffer) for its slot, within MAX_HELD_BYTES."""
        with self._lock:
            if (obj, j) in self._writes or self._bytes + len(data) > MAX_HELD_BYTES:
                return
            first = not self._writes
            self._writes[(obj, j)] = (obj, layout, index, j, bytes(data))
            self._bytes += len(data)
        if first:  # queued held: it runs when the hold ends (at once, if it just did)
            self.hold.submit(KEY, self._run)

    def get(self, obj: str, j: int) -> bytes | None:
        """The bytes of chunk ``j`` of ``obj`` when they wait here for their slot."""
        if not self._writes:
            return None
        with self._lock:
            held = self._writes.get((obj, j))
        return held[4] if held is not None else None

    def _run(self, done: Any) -> None:
        """Write what is kept (the SSD writes' thread), each let go once written, until
        nothing is left."""
        while True:
            with self._lock:
                writes = list(self._writes.items())
            if not writes:
                return
            for key, (obj, layout, index, j, data) in writes:
                self.write(obj, layout, index, j, data)
                with self._lock:
                    self._writes.pop(key, None)
                    self._bytes -= len(data)
