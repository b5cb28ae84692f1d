"""Shard builds that run behind the reads: a window whose shard admission lets into a
full RAM tier is read from its chunks at once, and the shard is decoded into the tier
by one background thread of this process.

Building a decoded 64 s shard costs ~20-30 ms (decode and write every chunk), ~10
windows' worth of reading.  Inline, every shard that displaces a resident one stalled
the read that admitted it; measured with one process at half the decoded bytes in RAM,
the epoch after the first spent 58-79 ms of its ~280 ms in three such builds, and read
fewer windows/s than with no RAM tier at all.  Behind the reads, a build runs on a core
the reading process leaves idle, or (all cores busy) costs what it cost before.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections.abc import Callable

log = logging.getLogger("zstore")

MAX_PENDING = 2  # builds queued or running; past that a shard waits for its next read


class BehindBuilds:
    """One background thread that runs builds, each key at most once at a time."""

    def __init__(self, name: str = "zstore-build"):
        self.name = name
        self.pending: set[str] = set()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pool: cf.ThreadPoolExecutor | None = None

    def __contains__(self, key: str) -> bool:
        return key in self.pending

    def submit(self, key: str, build: Callable[[], None]) -> bool:
        """Queue ``build`` for ``key``; False when it is already pending or the queue is
        full (the caller reads around the shard; a later read asks again)."""
        with self._lock:
            if key in self.pending or len(self.pending) >= MAX_PENDING:
                return False
            self.pending.add(key)
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix=self.name)
        self._pool.submit(self._run, key, build)
        return True

    def _run(self, key: str, build: Callable[[], None]) -> None:
        try:
            build()
        except Exception as e:  # the shard stays out; reads of it go to its chunks
            log.warning(
                "zstore: building %s in the RAM tier failed (%s: %s); its windows "
                "are read from the chunks",
                key,
                type(e).__name__,
                e,
            )
        finally:
            with self._lock:
                self.pending.discard(key)
                self._idle.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no build is pending; False if ``timeout`` passed first."""
        with self._lock:
            return self._idle.wait_for(lambda: not self.pending, timeout)
