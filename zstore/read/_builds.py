"""Shard builds that run behind the reads, in background threads of each process.

Three kinds of build go there:

- **Fills** (the tier has room, as in the first epoch): the read that first touches a
  shard fetches its window's chunks under the node's lock for the shard, serves the
  window from them at once, and hands the lock and those chunks' bytes to this thread,
  which fetches the shard's other chunks, builds it into the tier and releases the lock.
  Inline, the first epoch with a RAM tier read at 0.3-0.4x of no tier and its first
  batch took ~6x as long: page faults of fresh shard memory, tmpfs writes, checksums and
  decoding every chunk of every shard touched, all in front of the reads
  (docs/benchmarks-notes.md, "Where the first epoch goes").
- **Displacing builds** (the tier is full and admission lets a shard in): the window is
  read from its chunks, and the shard is built here from all its chunks.  Building a
  decoded 64 s shard costs ~20-30 ms (decode and write every chunk), ~10 windows' worth
  of reading; inline, the epoch after the first spent 58-79 ms of its ~280 ms in three
  such builds (one process, half the decoded bytes in RAM).

- **Whole-shard SSD writes** (``fetch="shard"``), in a second queue and thread of their
  own: the read that fetches a shard object whole hands it, with the node's fill lock
  for it, to that thread, which writes it to the SSD tier and releases the lock; until
  then the process reads it from memory (``zstore.read._ssd_shards``).

A build runs on a core the reading process leaves idle, or (all cores busy) costs what
it cost before.  A process's work behind the reads waits for its first read to be
served (``held``): the first batch of a fresh job is read with no fill beside it (one
rank on a cold NFS-like origin: 1.22x of no tiers' time to the first batch with the
fills started at once, 1.05x held; docs/benchmarks-notes.md), and for the node's other
first reads, for HOLD_AT_MOST seconds at most, on a timer: held work keeps the node's
locks for its shards, and a process that stops reading (a rank in an allreduce) must
not keep them from the reads that wait for them.  The form the reads fill (``chunks``)
writes nothing while held, and a form of whole shards asks for no fill during the
process's own first read (``ShardForm._decide``): those reads cost what they cost with
no tier, and their shards are filled when read again.  The queue is bounded in shards
and in bytes handed over; past that a shard is read from its chunks and asked for again
on its next read, so the fill never waits in front of a read.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from zstore.cache import FirstReads

log = logging.getLogger("zstore")

#: Shards queued or building; past that a shard's windows are read from its chunks and
#: the shard waits for its next read.  One build runs at a time.
MAX_PENDING = 48
#: Encoded bytes of the windows' chunks that queued fills hold (a few batches' worth).
MAX_PENDING_BYTES = 64 * 2**20
#: Shard objects fetched whole that queued SSD writes hold (about a batch's first
#: touches of 7 MB shards).  They have a queue and a thread of their own: sharing the
#: fills' (one thread, 48 shards, 64 MB), they took its room and the RAM tier's fills
#: lagged into the epochs after the first (S3-like, one rank: epoch 2 at 0.5x).
MAX_WRITE_BYTES = 128 * 2**20
#: Bytes of shard objects fetched whole that queued fills hold: the shards' chunks,
#: handed over from memory so neither the fill nor this process's reads of them before
#: it is done read them back from the SSD tier (``zstore.read._shard_fills``).  About
#: the fills queue's MAX_PENDING shards of 5-7 MB: at 128 MB, one rank's cold NFS-like
#: first epoch still read a third of its shards back from the SSD tier's device (0.80x
#: of no tiers against 0.89x at 256 MB).  Counted apart from MAX_PENDING_BYTES:
#: counted in it, they took the queue's room and the fills moved from epoch 0 into
#: epoch 1 (S3-like, 4 ranks: epoch 1 at 201 windows/s against 288).
MAX_AT_HAND_BYTES = 256 * 2**20


def room(pending: int, pending_bytes: int, n: int, nbytes: int, max_bytes: int) -> bool:
    """Whether a queue of fills holding ``pending`` shards and ``pending_bytes`` takes
    ``n`` more holding ``nbytes``: MAX_PENDING shards, ``max_bytes`` (one job always,
    when none is pending)."""
    return pending + n <= MAX_PENDING and (
        nbytes == 0 or not pending or pending_bytes + nbytes <= max_bytes
    )


class ByteBudget:
    """Bytes taken and given back by several threads, never more than ``limit`` at once
    (one taking is always allowed when none is out)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.used and self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes


class _ForkGate:
    """Held by builds while they work, and by a fork while it forks: a process never
    forks while a build is inside SQLite, blosc or malloc.  A child forked in the middle
    of one inherits that library's lock held by a thread it does not have, and waits
    for it forever (seen: a DataLoader worker, forked while a build was in SQLite, hung
    in ``sqlite3Malloc`` opening its tier).  A fork waits at most one shard's build.

    Builds share it: the RAM fills and the SSD writes are in different threads, and one
    must not wait for the other.  As one lock, a fill waited for the SSD write beside it,
    and that write for the SSD tier's index, which the other ranks' writes held in
    turn: with 4 ranks the RAM tier's fill stalled for whole epochs (its size stayed
    flat for 2-3 epochs; docs/benchmarks-notes.md)."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(
            before=self._close, after_in_parent=self._open, after_in_child=self._reset
        )

    def _reset(self) -> None:  # the child's copy may be held by threads it does not have
        self._cond = threading.Condition(threading.Lock())
        self._inside = 0  # builds in the gate now
        self._forking = False

    def _close(self) -> None:
        """Before a fork: wait for the builds inside, and let no new one in."""
        with self._cond:
            self._cond.wait_for(lambda: not self._forking)  # another thread's fork
            self._forking = True
            self._cond.wait_for(lambda: self._inside == 0)

    def _open(self) -> None:
        with self._cond:
            self._forking = False
            self._cond.notify_all()

    def locked(self) -> bool:
        """Whether a build is inside (a fork now would wait for it)."""
        return self._inside > 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._forking)
            self._inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                if not self._inside:
                    self._cond.notify_all()


FORK_GATE = _ForkGate()


#: Seconds a process's builds wait, once its own first read is served, for the node's
#: other processes' first reads.
HOLD_AT_MOST = 5.0


class FirstReadHold:
    """Builds held until this process's first read is served and, with several
    processes on the node, until theirs are too (at most HOLD_AT_MOST seconds more).

    Held for the process's own first read only, the ranks that were served first
    started their fills and SSD writes beside the others' first batches: with 4 ranks
    on a cold origin, the slowest rank's first batch took ~1.4x as long as with no
    tiers (docs/benchmarks-notes.md)."""

    def __init__(self, builds: list[BehindBuilds], marks: FirstReads):
        self.builds, self.marks = builds, marks
        self.holding = True
        self._served: float | None = None  # when this process's first read was served
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        _release_at_exit(self)

    @property
    def first_running(self) -> bool:
        """Whether this process's first read is running (not served yet, nor released)."""
        return self.holding and self._served is None

    def begin(self) -> None:
        """A read starts: the first one marks this process as starting."""
        if self.first_running:
            self.marks.begin()

    def served(self) -> None:
        """A read was served (or failed): release the builds when no other process on
        the node is still on its first read, and HOLD_AT_MOST seconds after the first
        one at the latest, whether or not this process reads again (a rank waiting in
        an allreduce for the others reads nothing, and its held fills keep the node's
        locks for their shards)."""
        if not self.holding:
            return
        if self._served is None:
            self.marks.end()
            self._served = time.monotonic()
            with self._lock:
                if self.holding:
                    self._timer = threading.Timer(HOLD_AT_MOST, self.release)
                    self._timer.daemon = True
                    self._timer.start()
        if time.monotonic() - self._served >= HOLD_AT_MOST or not self.marks.others():
            self.release()

    def release(self) -> None:
        """Start the builds now (``settle()``, ``zstore cache warm``, all served, or
        HOLD_AT_MOST passed)."""
        with self._lock:
            self.holding = False
            timer, self._timer = self._timer, None
            self.marks.end()
        if timer is not None and timer is not threading.current_thread():
            timer.cancel()
        for builds in self.builds:
            builds.release()


_HOLDS: weakref.WeakSet[FirstReadHold] = weakref.WeakSet()
_REGISTERED = -1  # the process that registered _release_all


def _release_all() -> None:
    for hold in list(_HOLDS):
        hold.release()


# A process that forks (DataLoader workers) releases its held builds first: queued
# fills hold the node's locks for their shards, and children must not inherit them
# (measured: a torchrun job's workers, forked while the rank held its first fills,
# left shards of the store unfetched).  Registered after the fork gate, so it runs
# before the gate closes: the fork then waits for the build that has started.
os.register_at_fork(before=_release_all)


def _release_at_exit(hold: FirstReadHold) -> None:
    """Release ``hold`` when the process exits, before its threads are joined: a process
    (a DataLoader worker, say) whose reads all ran while other processes were on their
    first reads would otherwise exit with its fills never started, and the node's tiers
    would miss those shards (threading's hook runs in multiprocessing's children too,
    where ``atexit`` does not)."""
    global _REGISTERED
    _HOLDS.add(hold)
    if _REGISTERED == os.getpid():
        return
    _REGISTERED = os.getpid()
    register = getattr(threading, "_register_atexit", None)
    try:
        (register or atexit.register)(_release_all)
    except RuntimeError:  # the interpreter is shutting down already
        pass


class BehindBuilds:
    """One background thread that runs builds, each key at most once at a time."""

    def __init__(
        self,
        name: str = "zstore-build",
        on_idle: Callable[[], None] | None = None,
        max_bytes: int = MAX_PENDING_BYTES,
        held: bool = False,
    ):
        self.name = name
        #: builds are queued but not started until :meth:`release` (or :meth:`wait`)
        self.held = held
        self.max_bytes = max_bytes
        #: run in the builder thread each time the queue drains (drop its scratch memory)
        self.on_idle = on_idle
        self.pending: set[str] = set()
        self.pending_bytes = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._jobs: collections.deque[tuple[list[str], Any, int]] = collections.deque()
        self._thread: threading.Thread | None = None  # exits when the queue drains
        self._last: threading.Thread | None = None

    def __contains__(self, key: str) -> bool:
        return key in self.pending

    def has_room(self, n: int = 1, nbytes: int = 0) -> bool:
        """Whether ``n`` more keys holding ``nbytes`` can be queued now."""
        with self._lock:
            return self._room(n, nbytes)

    def _room(self, n: int, nbytes: int) -> bool:
        return room(len(self.pending), self.pending_bytes, n, nbytes, self.max_bytes)

    def submit(
        self, key: str | list[str], build: Callable[[Callable[[str], None]], None], nbytes: int = 0
    ) -> bool:
        """Queue ``build`` for ``key`` (or several keys, built by one job), holding
        ``nbytes``; False when one is already pending or the queue is full (the caller
        reads around the shard; a later read asks again).  ``build`` is called with a
        function that marks one of its keys done (else all are, when it returns)."""
        keys = [key] if isinstance(key, str) else list(key)
        with self._lock:
            if any(k in self.pending for k in keys) or not self._room(len(keys), nbytes):
                return False
            self.pending.update(keys)
            self.pending_bytes += nbytes
            self._jobs.append((keys, build, nbytes))
            if not self.held:
                self._start()
        return True

    def release(self) -> None:
        """Start the builds held back so far, and every later one as it comes."""
        with self._lock:
            self.held = False
            self._start()

    def _start(self) -> None:
        """Start the thread when jobs wait and none runs (under ``_lock``)."""
        if self._thread is None and self._jobs:
            # Not a daemon: a process that exits finishes its queued fills (at most
            # MAX_PENDING shards) instead of leaving a value file half written (its
            # mode and bytes unfinished until a later sweep removes it).
            self._thread = self._last = threading.Thread(target=self._drain, name=self.name)
            self._thread.start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    self._idle.notify_all()
                    return
                keys, build, nbytes = self._jobs.popleft()
            self._run(keys, build, nbytes)

    def _done(self, key: str) -> None:
        with self._lock:
            self.pending.discard(key)

    def _run(
        self, keys: list[str], build: Callable[[Callable[[str], None]], None], nbytes: int
    ) -> None:
        try:
            build(self._done)
        except Exception as e:  # the shard stays out; reads of it go to its chunks
            log.warning(
                "zstore: filling %s into the cache behind the reads failed (%s: %s); "
                "it stays out, and its windows are read from the origin or other tiers",
                ", ".join(keys),
                type(e).__name__,
                e,
            )
        finally:
            with self._lock:
                self.pending.difference_update(keys)
                self.pending_bytes -= nbytes
                idle = not self.pending
            if idle and self.on_idle is not None:
                self.on_idle()  # waiters wake when the thread ends (_drain)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no build is pending and the thread has ended (builds held back
        start now); False if ``timeout`` passed first."""
        self.release()
        with self._lock:
            done = self._idle.wait_for(lambda: not self.pending and self._thread is None, timeout)
            last = self._last
        if done and last is not None and last is not threading.current_thread():
            last.join(timeout)
            return not last.is_alive()
        return done
