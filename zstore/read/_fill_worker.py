"""A reading process's fill process (:mod:`zstore.read._fill_process`): ``main()`` with
``sys.argv[1]`` its end of a Unix socket pair (a descriptor number).

It opens the reader it is sent (pickled: the store, the tiers, the origin), answers
``("ready",)``, then builds the shards each job names into the node's RAM tier from the
chunks' bytes sent with it (the windows' own, which the reading process fetched) and the
rest it fetches, under the node's locks for them, passed along, which it releases as
each shard is in (``("done", key)``; ``("failed", keys, why)`` for a job that failed,
whose shards stay out).  At the end of the stream (the reading process has ended, or
let it go) it finishes the jobs it has and exits: each holds the node's lock of a shard
that no other process builds until then.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import socket
import sys
import threading
from typing import Any

from zstore.format import Span
from zstore.read._fill_chunks import RestFetch
from zstore.read._fill_messages import receive, send


def _receive_all(sock: socket.socket, form: Any, jobs: queue.Queue[Any]) -> None:
    """Queue every job received (so the reading process never waits on a full socket),
    with the fetch of its shards' other chunks started at once where the origin is
    remote and read by ranges (as the reading process's thread does: the fills do not
    wait for each other's round trips); None at the end."""
    try:
        while True:
            got = receive(sock)
            if got is None:
                break
            (shards, have, indexes), _ = got
            todo = [(layout, s, Span(0, 0), key) for layout, s, key, _ in shards]
            later = RestFetch()
            try:
                rest, nbytes = form._rest_of(todo, have, indexes)
                form._fetch_rest(rest, nbytes, indexes, later)  # sets it done, now or later
            except Exception:
                later.done.set()  # likewise
            jobs.put((todo, got, later))
    except OSError:
        pass
    jobs.put(None)


def serve(sock: socket.socket) -> None:
    first = receive(sock)
    if first is None:
        return
    reader = first[0]
    if reader.cache is not None:  # this process fills in its own thread: no helper of its own
        reader.cache = dataclasses.replace(reader.cache, fills="thread")
    reader.open()
    form = reader.form
    if form is None or not hasattr(form, "_finish_builds"):
        send(sock, ("unfit", "the reader opened here has no RAM tier of whole shards"))
        return
    lock = threading.Lock()

    def reply(message: tuple[Any, ...]) -> None:
        with lock:
            try:
                send(sock, message)
            except OSError:
                pass  # the reading process has gone: the builds go on for the node

    reader.hold.release()  # no first read to wait for here
    send(sock, ("ready", os.getpid()))
    jobs: queue.Queue[Any] = queue.Queue()
    threading.Thread(target=_receive_all, args=(sock, form, jobs), daemon=True).start()
    while (job := jobs.get()) is not None:
        todo, ((shards, have, indexes), fds), later = job
        locks: dict[str, list[int]] = {}
        at = 0
        for _, _, key, nfds in shards:
            locks[key] = fds[at : at + nfds]
            at += nfds
        try:
            form._finish_builds(
                todo,
                have,
                locks,
                indexes,
                (0, []),
                later,
                lambda key: reply(("done", key)),
            )
        except Exception as e:  # its shards stay out (their locks released there)
            reply(("failed", [key for *_, key, _ in shards], f"{type(e).__name__}: {e}"))


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    try:
        serve(sock)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the reading process has gone (a short job can end before this one starts)
    except Exception as e:  # said to the reading process, which logs it and fills itself
        try:
            send(sock, ("unfit", f"it failed ({type(e).__name__}: {e})"))
        except OSError:
            pass
        sys.exit(1)
    finally:
        sock.close()


if __name__ == "__main__":
    main()
