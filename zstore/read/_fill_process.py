"""The fills behind the reads, in a process of their own.

A fill behind the reads (:mod:`zstore.read._builds`) decodes and writes a whole shard
for every shard the first epoch touches.  In a thread of the reading process it runs on
the core the reads leave idle, but shares their interpreter lock: on 50,000 packed
utterances of 0.25-1 s read by one process, the build thread handed the lock back and
forth with the batch thread ~150,000 times in an epoch, and epoch 0 read at 0.5-0.6x of
no RAM tier (docs/benchmarks-notes.md).  A helper process has a lock of its own.

:class:`FillProcess` is a reading process's end: it starts the helper
(``python -m zstore.read._fill_worker``) on its first fill, sends it the reader
(pickled, a few hundred bytes), and then each fill: the shards, the bytes of the
windows' chunks this process fetched for them, and the node's locks for them, passed
as descriptors (:mod:`zstore.read._fill_messages`): the lock is held throughout, so the
origin is still read once per chunk for the node.  A receiving thread learns which
shards are in.

Until the helper has answered (its start takes ~0.5-1 s), and for good once it has
failed or exited, :meth:`FillProcess.ready` is False and the caller fills in its own
thread as before.  The helper ends with the reading process: at the end of the socket
it finishes the shards it holds and exits; a killed helper's locks are dropped by the
kernel, and its shards are filled by a later read.

Where it runs (``CacheConfig(fills=...)``): ``"auto"`` picks it for a store of packed
items, where the node's reading processes (local ranks x DataLoader workers, and the
processes seen using its tiers) are fewer than its cores.  Packed items because there
a batch is one gather in the reading thread, which holds the interpreter lock, and a
core is idle: epoch 0 read at ~1.4-1.5x of no tier with the helper against 0.6x with
the thread.  A long recording's windows are decoded by WindowLoader's threads, which
release that lock and use the cores: there the helper read epoch 0 at 0.85-0.95x of
the thread (explicit ``ram_format="decoded"`` or ``"encoded"``, one process), and its
fills ran later into epoch 1.  Where every core reads, a process per reader would add
memory and no CPU.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from zstore.read._builds import MAX_PENDING_BYTES, room
from zstore.read._fill_messages import receive, send

log = logging.getLogger("zstore")

#: Processes this one has handed fills to; a forked child closes its copies of their
#: sockets (a copy kept open would keep a helper waiting for a process that has ended).
_OPEN: set[FillProcess] = set()


def _forget_in_child() -> None:
    for fills in list(_OPEN):
        fills.forget()
    _OPEN.clear()


os.register_at_fork(after_in_child=_forget_in_child)


#: The helper's program: at the lowest priority from its first instruction (its imports
#: and the reader's opening take ~0.6 s of CPU), so that it takes the CPU the reads leave
#: idle and not theirs.  At normal priority its start and builds took the reads' CPU
#: where they used more than one core (long recordings through WindowLoader's threads,
#: one process: epoch 0 at 0.68-0.71x of fills in a thread; at the lowest, 0.84-0.97x;
#: docs/benchmarks-notes.md).
NICE = 19
#: Seconds a send to the helper may block before the helper is given up.
SEND_WAIT = 10
_MAIN = f"import os; os.nice({NICE}); from zstore.read._fill_worker import main; main()"


def reading_processes() -> int:
    """The node's reading processes as this one sees them: its local ranks
    (``LOCAL_WORLD_SIZE``, set by ``torchrun``) times its DataLoader's workers."""
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    workers = 1
    data = sys.modules.get("torch.utils.data")
    if data is not None:
        info = data.get_worker_info()
        if info is not None:
            workers = max(1, int(info.num_workers))
    return ranks * workers


def node_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def wanted(setting: str, others: int = 0, *, packed: bool = True) -> bool:
    """Whether fills run in a process (``fills`` resolved: auto, process, thread), with
    ``others`` processes seen using the node's tiers besides this one; ``packed``: the
    store's items are packed (under "auto", only those: see the module's docstring)."""
    if setting == "auto":
        return packed and max(reading_processes(), others + 1) < node_cores()
    return setting == "process"


class FillProcess:
    """A reading process's fill process: started on first use, with the same
    bounds as the thread's queue (MAX_PENDING shards, MAX_PENDING_BYTES)."""

    def __init__(self, reader: Any, setting: str = "process", others: Callable[[], set[int]] = set):
        #: pickled to the helper, which opens it there (weak: the helper's socket is
        #: closed, and it exits, when the reader goes)
        self.reader = weakref.ref(reader)
        weakref.finalize(reader, self.close)
        self.held = True  # released with the reader's other builds (FirstReadHold)
        #: ``fills`` resolved; under "auto" the helper starts only where the node's
        #: processes, ``others()`` of them seen using its tiers, leave a core idle
        self.setting, self.others = setting, others
        self.pending: dict[str, Callable[[str], None]] = {}  # key -> its reader's drop
        self.pending_bytes = 0
        self._job_bytes: dict[str, int] = {}  # first key of a job -> its bytes
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._send = threading.Lock()
        self._state = "new"  # new, starting, ready, over
        self._answered = threading.Event()  # ready, or over
        #: shards the helper has built (for tests and stats)
        self.built = 0
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def ready(self) -> bool:
        """Whether fills can go to the helper now (starting it on the first ask once the
        reader's builds are released: by then the node's other processes have read)."""
        if self._state == "new" and not self.held:
            self._start()
        return self._state == "ready" and not self.held

    def release(self) -> None:
        self.held = False

    def has_room(self, n: int = 1, nbytes: int = 0) -> bool:
        with self._lock:
            return room(len(self.pending), self.pending_bytes, n, nbytes, MAX_PENDING_BYTES)

    def _start(self) -> None:
        """Start the helper (~0.5 ms here: ``subprocess`` uses vfork; the helper's
        imports and opening run in it, at the lowest priority)."""
        with self._lock:  # one thread starts it
            if self._state != "new":
                return
            self._state = "starting"
        if self.setting == "auto" and not wanted("auto", len(self.others() - {os.getpid()})):
            self._state = "over"  # every core reads: the fills stay in the thread
            self._answered.set()
            return
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as e:
            self._over(f"no socket pair ({e})")
            return
        package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package, env.get("PYTHONPATH")) if p)
        try:
            with theirs:
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", _MAIN, str(theirs.fileno())],
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    env=env,
                )
            reader = self.reader()
            if reader is None:
                raise RuntimeError("its reader has gone")
            send(ours, reader)
        except Exception as e:  # no interpreter to start, or a reader that cannot pickle
            ours.close()
            self._over(f"it could not be started ({type(e).__name__}: {e})")
            return
        # A send that cannot finish in SEND_WAIT seconds (a helper stopped or stuck, its
        # socket full) fails, and the fills come back here: never a read waiting on it.
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_WAIT, 0))
        self._sock = ours
        _OPEN.add(self)
        threading.Thread(target=self._receive, name="zstore-fill-replies", daemon=True).start()

    def submit(
        self,
        shards: list[tuple[Any, int, str, list[int]]],
        have: dict[tuple[str, int], tuple[Any, Any]],
        indexes: dict[str, Any],
        nbytes: int,
        dropped: Callable[[str], None],
    ) -> bool:
        """Hand the helper the builds of ``shards`` ((layout, shard, key, the node's
        lock descriptors for it)) with the chunks' bytes in ``have``; True when it took
        them, and then the descriptors are its (closed here: the lock stays held
        through the helper's copies).  ``dropped(key)`` runs here once the shard is in,
        or failed."""
        keys = [key for _, _, key, _ in shards]
        with self._lock:
            if self._state != "ready" or any(k in self.pending for k in keys):
                return False
            for key in keys:
                self.pending[key] = dropped
            self.pending_bytes += nbytes
            self._job_bytes[keys[0]] = nbytes
        fds = [fd for *_, held in shards for fd in held]
        job = (
            [(layout, s, key, len(held)) for layout, s, key, held in shards],
            {k: (r, bytes(d) if isinstance(d, memoryview) else d) for k, (r, d) in have.items()},
            indexes,
        )
        try:
            with self._send:
                send(self._sock, job, fds)  # type: ignore[arg-type]
        except OSError as e:  # its shards, these among them, are settled there
            self._over(f"it stopped taking fills ({e})")
            return False
        return True

    def _receive(self) -> None:
        sock = self._sock
        assert sock is not None
        why = "it ended"
        try:
            while (got := receive(sock)) is not None:
                message = got[0]
                if message[0] == "ready":
                    self._state = "ready"
                    self._answered.set()
                elif message[0] == "done":
                    self.built += 1
                    self._settle([message[1]])
                elif message[0] == "failed":
                    log.warning(
                        "zstore: filling %s into the cache in the fill process failed "
                        "(%s); it stays out, and its windows are read from the origin or "
                        "other tiers",
                        ", ".join(message[1]),
                        message[2],
                    )
                    self._settle(message[1])
                elif message[0] == "unfit":
                    why = message[1]
                    break
        except OSError as e:
            why = f"its socket failed ({e})"
        self._over(why)

    def _settle(self, keys: list[str]) -> None:
        """``keys`` are built or failed: drop what this process held for them."""
        drops = []
        with self._lock:
            for key in keys:
                drop = self.pending.pop(key, None)
                if drop is not None:
                    drops.append((key, drop))
                self.pending_bytes -= self._job_bytes.pop(key, 0)
            if not self.pending:
                self._idle.notify_all()
        for key, drop in drops:
            drop(key)

    def _over(self, why: str) -> None:
        """The helper is gone (or never came): its shards stay out, fills go back to
        this process's thread."""
        if self._state != "over":
            self._state = "over"
            _OPEN.discard(self)
            if self._sock is not None:
                self._sock.close()
            proc = self._proc
            code = None
            if proc is not None:
                try:  # it has closed its end: it is exiting (or has been killed)
                    code = proc.wait(30)
                except subprocess.TimeoutExpired:
                    pass
            if why != "it ended" or code not in (None, 0):
                log.warning(
                    "zstore: the fill process of %s: %s%s; this process fills the RAM "
                    "tier in a thread of its own instead",
                    getattr(self.reader(), "url", "the store"),
                    why,
                    f" (exit code {code})" if code not in (None, 0) else "",
                )
        with self._lock:
            keys = list(self.pending)
        self._settle(keys)
        self._answered.set()  # after the warning: whoever waits for the answer sees it

    def started(self, timeout: float | None = None) -> bool:
        """Start the helper if need be and wait for its answer: whether it takes fills."""
        if self._state == "new":
            self._start()
        self._answered.wait(timeout)
        return self._state == "ready"

    @property
    def pid(self) -> int | None:
        """The helper's process id, once started."""
        return self._proc.pid if self._proc is not None else None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the helper has built every shard handed to it."""
        with self._lock:
            return self._idle.wait_for(lambda: not self.pending, timeout)

    def forget(self) -> None:
        """In a forked child: close this copy of the socket, use the helper no more."""
        self._state = "over"
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self.pending.clear()

    def close(self) -> None:
        """Let the helper go: it finishes the shards it holds and exits."""
        _OPEN.discard(self)
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
