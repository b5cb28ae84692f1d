"""Processes of this host: whether one is running, and what tells this host's processes
from another container's that shares its host name.

A shared leaf: every layer may import it; it imports nothing of zstore.
"""

from __future__ import annotations

import contextlib
import os


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def boot_and_namespace() -> dict[str, str]:
    """This process's boot id and pid namespace (Linux; empty elsewhere): two
    containers may share a host name, but a pid means the same process only where
    both match."""
    out = {}
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            out["boot"] = f.read().strip()
        out["pid_ns"] = os.readlink("/proc/self/ns/pid")
    return out
