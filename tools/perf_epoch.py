"""Where the node's CPU goes in epoch 0, every process and thread and the kernel: ``perf``.

cProfile sees one Python thread; with 4 ranks the fills run in background threads, and
much of the time is in the kernel (fresh pages, tmpfs writes) or in C (blosc, crc32c).
Here ``perf record -a -g`` samples every CPU while the ranks read epoch 0 (started and
stopped through perf's control FIFO by rank 0, between barriers), and each sample is
put in a category by the functions on its stack.  Used by tools/profile_first_epoch.py
when ``perf`` is on the PATH and may sample the whole machine.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

FREQ = 1999  # samples per second per CPU

#: category -> the functions that put a sample in it, and whether they must be the
#: sample's own function (else anywhere on its stack); the first match wins.
CATEGORIES: list[tuple[str, tuple[str, ...], bool]] = [
    ("fresh pages: the kernel zeroing them", ("clear_page", "folio_zero"), False),
    ("decoding (blosc, lz4)", ("bshuf", "LZ4_", "blosc"), True),
    ("crc32c", ("crc32c",), True),
    ("tmpfs writes (the RAM tier)", ("copy_folio_from_iter", "shmem_"), False),
    ("file reads (the page cache)", ("_copy_to_iter", "filemap_read"), False),
    ("copies into the batch buffers", ("block_rows", "lines_avx", "fastcopy", "widen_"), True),
    ("other copies (memmove, narrowing shards)", ("memmove", "memcpy", "narrow_"), True),
    ("other page faults", ("page_fault",), False),
    ("SQLite", ("sqlite3",), False),
    ("other kernel", ("[kernel",), True),
]
OTHER = "Python and the rest"


def available() -> str | None:
    """None when perf can sample the whole machine here, else why not."""
    if shutil.which("perf") is None:
        return "perf is not on the PATH"
    try:
        level = int(open("/proc/sys/kernel/perf_event_paranoid").read())
    except (OSError, ValueError):
        level = 2
    if os.geteuid() != 0 and level > 0:
        return f"perf_event_paranoid is {level} (sampling every CPU needs 0, or root)"
    try:  # root in a container may still be refused
        probe = subprocess.run(
            ["perf", "record", "-q", "-a", "-o", os.devnull, "--", "true"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"perf record -a failed ({e})"
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["no message"])[-1]
        return f"perf record -a failed: {last}"
    return None


def _ctl(fifos: tuple[str, str], command: str) -> None:
    """Send ``command`` to perf and wait for its answer; fails at once (instead of
    waiting forever) when perf is not reading its control FIFO."""
    try:
        fd = os.open(fifos[0], os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        raise RuntimeError(f"perf is not reading its control FIFO ({e})") from None
    with os.fdopen(fd, "w") as f:
        f.write(command + "\n")
    with open(fifos[1]) as f:
        f.readline()


def rank_main(
    store: str,
    cache: Any,
    fifos: tuple[str, str],
    r: int,
    ranks: int,
    barrier: Any,
    queue: Any,
) -> None:
    """One rank's epoch 0 (as in tools/profile_first_epoch.py), sampled from the moment
    every rank is ready until every rank is done."""
    from profile_first_epoch import RankLoader

    loader = RankLoader(store, cache, None, r, ranks)
    loader.set_epoch(0)
    barrier.wait()
    if r == 0:
        _ctl(fifos, "enable")
    barrier.wait()
    t0, n = time.perf_counter(), 0
    for batch in loader:
        n += batch["wav"].shape[0]
    seconds = time.perf_counter() - t0
    barrier.wait()
    if r == 0:
        _ctl(fifos, "disable")
    queue.put((seconds, n))


def categorize(script: str) -> collections.Counter[str]:
    """Samples per category from ``perf script -F comm,ip,sym,dso`` output; an idle
    CPU's samples (the ``swapper`` task) count as "idle"."""
    counts: collections.Counter[str] = collections.Counter()
    for stack in script.split("\n\n"):
        lines = [line.strip() for line in stack.strip().splitlines() if line.strip()]
        if len(lines) < 2:
            continue
        if lines[0].startswith("swapper"):
            counts["idle"] += 1
            continue
        for name, marks, own in CATEGORIES:
            where = lines[1] if own else " ".join(lines[1:])
            if any(mark in where for mark in marks):
                counts[name] += 1
                break
        else:
            counts[OTHER] += 1
    return counts


def sample(store: str, cache: Any, ranks: int) -> tuple[float, dict[str, float]]:
    """(windows/s for the node under perf, CPU seconds per category) of one epoch 0."""
    from zstore.testing import spawn_ranks

    with tempfile.TemporaryDirectory() as tmp:
        fifos = (os.path.join(tmp, "ctl"), os.path.join(tmp, "ack"))
        for fifo in fifos:
            os.mkfifo(fifo)
        data = os.path.join(tmp, "perf.data")
        perf = subprocess.Popen(
            ["perf", "record", "-q", "-a", "-g", "-F", str(FREQ), "-D", "-1", "-o", data,
             "--control", f"fifo:{fifos[0]},{fifos[1]}", "--", "sleep", "3600"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            got = spawn_ranks(
                rank_main, ranks, lambda r, b, q: (store, cache, fifos, r, ranks, b, q), timeout=600
            )
        finally:
            perf.send_signal(signal.SIGINT)  # perf writes its data and ends
            perf.wait(60)
        script = subprocess.run(
            ["perf", "script", "-i", data, "-F", "comm,ip,sym,dso"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    rate = sum(n for _, n in got) / max(s for s, _ in got)
    return rate, {k: v / FREQ for k, v in categorize(script).items()}


if __name__ == "__main__":  # a quick look: python tools/perf_epoch.py [RAM fraction]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from pathlib import Path

    import profile_first_epoch as pfe

    why = available()
    if why:
        sys.exit(why)
    store = pfe.prepare(Path("bench-data/first-epoch"))
    fraction = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    rate, cpu = sample(store, pfe.cache_config(fraction), 4)
    print(f"{rate:.0f} windows/s under perf")
    for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]):
        print(f"{k:32s} {v:.3f} s")
