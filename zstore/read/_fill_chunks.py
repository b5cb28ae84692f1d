"""Chunks of shards whose RAM fill is queued: fetched behind the reads, and shared with
this process's reads until the fill is done.

The read that first touches a shard the RAM tier admits fetches only its window's
chunks, and hands them to the fill (``zstore.read._shard_fills``).  From a remote origin
read by ranges (a URL, a network file system, no SSD tier that holds the store whole),
the shard's other chunks are then fetched at once, in a thread behind the reads, not by
the fill in its turn, one shard after another; and until the fill is done, this
process's other reads of the shard take its chunks from here instead of the origin.

Measured with ``tools/bench_cluster.py`` (8 processes as 4 nodes, RAM tiers only, the
S3-like model, NodeSampler): with the fill fetching each shard's rest in its turn, the
fills still ran when the second epoch began and its reads went to the origin again for
2-8% of the first epoch's bytes, and the first epoch read 1.5x the store
(docs/benchmarks-notes.md, "The cluster after the fills moved behind the reads").
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from zstore.format import ArrayLayout
from zstore.read._builds import FORK_GATE
from zstore.read._chunks import ChunkSource

log = logging.getLogger("zstore")

Chunk = tuple[ArrayLayout, int]


class RestFetch:
    """The other chunks of a queued fill's shards, fetched behind the reads (or not:
    ``done`` with nothing in ``got``, and the fill fetches them itself)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        #: (array path, chunk number) -> (request, bytes)
        self.got: dict[tuple[str, int], tuple[Any, Any]] = {}
        self.nbytes = 0  # what it took of the reader's at-hand budget

    def wait(self) -> dict[tuple[str, int], tuple[Any, Any]]:
        self.done.wait()
        return self.got


class FillChunks:
    """(array path, chunk number) -> the (request, bytes) a queued fill holds for it; and
    the thread that fetches fills' other chunks, with a chunk source of its own."""

    def __init__(self, source: ChunkSource):
        self._held: dict[tuple[str, int], tuple[Any, Any]] = {}
        self._lock = threading.Lock()  # the reads add and take, the builder drops
        self._source = source
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self._held)

    def add(self, chunks: Iterable[Chunk], raw: Iterable[tuple[Any, Any]]) -> None:
        """Hold ``raw`` (``source.raw(chunks)``) until :meth:`drop`."""
        with self._lock:
            for (layout, k), got in zip(chunks, raw):
                self._held[(layout.path, k)] = got

    def split(self, need: list[Chunk]) -> tuple[list[Chunk], list[tuple[Any, Any]], list[Chunk]]:
        """``need`` in two: the chunks held here with their bytes, and those to fetch."""
        if not self._held:
            return [], [], need
        found: list[Chunk] = []
        raw: list[tuple[Any, Any]] = []
        rest: list[Chunk] = []
        with self._lock:
            for layout, k in need:
                got = self._held.get((layout.path, k))
                if got is None:
                    rest.append((layout, k))
                else:
                    found.append((layout, k))
                    raw.append(got)
        return found, raw, rest

    def drop(self, chunks: Iterable[Chunk]) -> None:
        """Let go of ``chunks`` (their shard is filled, or its fill failed)."""
        with self._lock:
            for layout, k in chunks:
                self._held.pop((layout.path, k), None)

    def fetch(
        self, chunks: list[Chunk], indexes: dict[str, np.ndarray], nbytes: int, into: RestFetch
    ) -> None:
        """Fetch ``chunks`` (``indexes``: their shard indexes, as the reader holds them)
        in the thread behind the reads, into ``into`` and here; ``into`` is done when
        they are in, or when fetching them failed (its fill then fetches them itself)."""
        into.nbytes = nbytes

        def run() -> None:
            try:
                with FORK_GATE.held():  # tier lookups (SQLite) with an SSD tier
                    self._source.remember_indexes(indexes)
                    raw = self._source.raw(chunks, ram=False)
                into.got = {(layout.path, k): r for (layout, k), r in zip(chunks, raw)}
                self.add(chunks, raw)
            except Exception as e:  # the fill fetches them itself, and says so if it fails
                log.debug("zstore: fetching a fill's chunks behind the reads failed: %s", e)
            finally:
                into.done.set()

        try:
            self._executor().submit(run)
        except RuntimeError:  # no new work: the interpreter is shutting down
            into.done.set()  # the fill fetches them itself
        except BaseException:
            into.done.set()
            raise

    def _executor(self) -> cf.ThreadPoolExecutor:
        if self._pool is None or self._pid != os.getpid():
            self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="zstore-fill-fetch")
            self._pid = os.getpid()
        return self._pool
