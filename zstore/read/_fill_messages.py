"""Messages between a reading process and its fill process
(:mod:`zstore.read._fill_process`, :mod:`zstore.read._fill_worker`): a pickled object
with a length in front, over a Unix stream socket, and the descriptors that go with it
(the node's fill locks, handed over with ``SCM_RIGHTS``: a lock passed so is held by
the open file both processes share, never released in between)."""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

_HEAD = struct.Struct("!QI")  # payload bytes, descriptors
MAX_FDS = 256


def send(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
    """Send ``obj`` and ``fds`` (the caller serialises senders)."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    head = _HEAD.pack(len(payload), len(fds or ()))
    if fds:
        socket.send_fds(sock, [head], fds)
    else:
        sock.sendall(head)
    sock.sendall(payload)


def _exactly(sock: socket.socket, n: int, got: bytes = b"") -> bytes | None:
    parts = [got]
    have = len(got)
    while have < n:
        part = sock.recv(min(n - have, 1 << 20))
        if not part:
            return None
        parts.append(part)
        have += len(part)
    return b"".join(parts)


def receive(sock: socket.socket) -> tuple[Any, list[int]] | None:
    """The next object and its descriptors; None at the end of the stream."""
    head, fds, _, _ = socket.recv_fds(sock, _HEAD.size, MAX_FDS)
    if not head:
        return None
    whole = _exactly(sock, _HEAD.size, head)
    if whole is None:
        return None
    size, nfds = _HEAD.unpack(whole)
    payload = _exactly(sock, size)
    if payload is None or len(fds) != nfds:
        for fd in fds:
            socket.close(fd)
        return None
    return pickle.loads(payload), list(fds)
