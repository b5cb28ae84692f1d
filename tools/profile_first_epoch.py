"""Where the first epoch's time goes: one process, with and without a RAM tier.

    python tools/profile_first_epoch.py          # ~460 MB of synthetic HDF5 under ./bench-data/first-epoch

The speech store of issue #28 (32 items of 15-45 s, ~480 MB decoded).  Part 1:
``WindowLoader(batch_size=16)`` over ``windows_per_item=4`` random 10 s windows, epochs
0 to 3 (windows/s and time to the first batch), ``--reps`` interleaved repetitions of:
a local page-cached origin with no RAM tier and with one of 1.0, 0.5 and 0.33x the
decoded bytes, in 1 and 4 ranks (``DistributedSampler`` with 4); and cold NFS- and
S3-like origins (``zstore.testing``'s latency model) with a RAM tier of the whole data
and an SSD tier against no tiers, 1 and 4 ranks.  Each configuration runs in spawned
processes of its own; a section's configurations are interleaved, each one first in
turn, after one run that is not counted.  Part 2: epoch 0 read window by window in this
thread under cProfile, with a RAM tier that holds the data and without one: the
functions that take the time.  Part 3 (where ``perf`` may sample every CPU): epoch 0 of
4 ranks, no tier and a RAM tier of the whole data, under ``perf record -a``: the node's
CPU by category, kernel and background threads included (tools/perf_epoch.py).  Writes
the section "The first epoch" of docs/benchmarks.md and docs/benchmarks-first-epoch.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_docs import in_turn, replace_section  # noqa: E402
from perf_epoch import available as perf_available  # noqa: E402
from perf_epoch import sample as perf_sample  # noqa: E402

MARK_BEGIN = "<!-- first epoch: begin (tools/profile_first_epoch.py) -->"
MARK_END = "<!-- first epoch: end -->"
DECODED = 480e6
BUDGETS = {"none": 0.0, "1.0": 1.0, "0.5": 0.5, "0.33": 0.33}
#: with 4 ranks on 2 cores the fill ends in epoch 1 or 2 (once the batch buffers left
#: huge pages, epochs 0 and 1 no longer stall); epoch 3 is what later epochs read at
EPOCHS = 4


def prepare(work: Path) -> str:
    import zstore
    from zstore.testing.synthetic import SyntheticSpec, make_synthetic

    work.mkdir(parents=True, exist_ok=True)
    h5, store = work / "speech.h5", work / "speech.zarr"
    if not store.exists():
        make_synthetic(h5, SyntheticSpec(items=32), progress=True)
        zstore.convert(h5, store, rates={"wav": 16000, "act": 100}, overwrite=True)
    return str(store)


def ram_dir() -> str:
    """The RAM tier's directory: under ``--ram-dir`` (kept in the environment for the
    spawned configurations), else /dev/shm."""
    base = os.environ.get("ZSTORE_PROFILE_RAM_DIR") or (
        "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    )
    return os.path.join(base, "zstore-first-epoch")


def ssd_dir() -> str:
    return "/tmp/zstore-first-epoch-ssd"


def cache_config(fraction: float, ssd: bool = False) -> Any:
    """A fresh RAM tier of ``fraction`` x the decoded bytes (and an SSD tier); False:
    no tiers."""
    import zstore

    shutil.rmtree(ram_dir(), ignore_errors=True)
    shutil.rmtree(ssd_dir(), ignore_errors=True)
    if not fraction:
        return False
    return zstore.CacheConfig(
        ram_dir=ram_dir(),
        ram_bytes=int(DECODED * fraction),
        ssd_dir=ssd_dir() if ssd else None,
        ssd_bytes=int(2 * DECODED),
    )


def dataset(store: str, cache: Any, origin: dict[str, float] | None = None) -> Any:
    import zstore
    from zstore.testing import ModelledFileSystem

    fs = (
        ModelledFileSystem(latency=origin["latency"], bandwidth=origin["bandwidth"])
        if origin
        else None
    )
    return zstore.WindowDataset(
        store, window_seconds=10.0, windows_per_item=4, cache=cache, origin_fs=fs
    )


def timed_epochs(loader: Any, barrier: Any) -> list[tuple[float, float, int, float]]:
    """(seconds, seconds to the first batch, windows, the process's kernel CPU seconds)
    of each of the EPOCHS epochs, each started by every rank together."""
    out = []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        barrier.wait()
        sys0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        t0, n, first = time.perf_counter(), 0, 0.0
        for batch in loader:
            n += batch["wav"].shape[0]
            first = first or time.perf_counter() - t0
        kernel = resource.getrusage(resource.RUSAGE_SELF).ru_stime - sys0
        out.append((time.perf_counter() - t0, first, n, kernel))
    return out


class RankLoader:
    """One rank's ``WindowLoader(batch_size=16)`` over ``DistributedSampler``;
    ``set_epoch`` moves both."""

    def __init__(self, store: str, cache: Any, origin: Any, r: int, ranks: int) -> None:
        from torch.utils.data.distributed import DistributedSampler

        import zstore

        ds = dataset(store, cache, origin)
        self.sampler: Any = DistributedSampler(ds, num_replicas=ranks, rank=r, shuffle=True, seed=0)
        self.loader = zstore.WindowLoader(ds, batch_size=16, sampler=self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Any:
        return iter(self.loader)


def rank_main(
    store: str, cache: Any, origin: Any, r: int, ranks: int, barrier: Any, queue: Any
) -> None:
    queue.put(timed_epochs(RankLoader(store, cache, origin, r, ranks), barrier))


def epochs(
    store: str, fraction: float, ranks: int = 1, origin: dict[str, float] | None = None
) -> list[tuple[float, float, float]]:
    """(windows/s for the node, seconds to the first batch, the ranks' kernel CPU
    seconds) of each epoch, over
    ``ranks`` spawned processes on one fresh node cache (an SSD tier too when the
    origin is modelled).  Every configuration runs in processes of its own, as a
    user's job does (one rank used to run in this process, after the configurations
    before it, with their threads, maps and heap)."""
    from zstore.testing import spawn_ranks

    cache = cache_config(fraction, ssd=origin is not None)
    got = spawn_ranks(
        rank_main, ranks, lambda r, b, q: (store, cache, origin, r, ranks, b, q), timeout=1800
    )
    return [
        (
            sum(g[e][2] for g in got) / max(g[e][0] for g in got),
            max(g[e][1] for g in got),
            sum(g[e][3] for g in got),
        )
        for e in range(EPOCHS)
    ]


def profile(store: str, fraction: float, top: int = 10) -> dict[str, Any]:
    ds = dataset(store, cache_config(fraction))
    order = np.random.default_rng(0).permutation(len(ds))
    ds.reader.open()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for i in order:
        ds[int(i)]
    prof.disable()
    seconds = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(
        ((k[2] if k[0] == "~" else f"{Path(k[0]).name}:{k[2]}", v[2]) for k, v in stats.items()),
        key=lambda r: -r[1],
    )[:top]
    return {"seconds": seconds, "windows": len(order), "top": rows}


PERF_CONFIGS = {"none": 0.0, "RAM 1.0": 1.0}


def where_cpu_goes(store: str, reps: int) -> dict[str, Any]:
    """Epoch 0 of 4 ranks (local) under ``perf``, no tier and a RAM tier of the whole
    data interleaved: {"why": reason it did not run} or {config: [(windows/s, CPU
    seconds per category), ...]}."""
    why = perf_available() if reps else "--perf-reps 0"
    if why:
        print("not sampled with perf:", why, flush=True)
        return {"why": why}
    out: dict[str, Any] = {k: [] for k in PERF_CONFIGS}
    for label, fraction in in_turn(list(PERF_CONFIGS.items()), reps):
        out[label].append(perf_sample(store, cache_config(fraction), 4))
        print("perf", label, out[label][-1], flush=True)
    return out


def cpu_lines(cpu: dict[str, Any], reps: int) -> list[str]:
    """The docs' table of where epoch 0's CPU goes (medians per category)."""
    if "why" in cpu:
        return ["", f"(Epoch 0 was not sampled with perf: {cpu['why']}.)"]
    cats = sorted(
        {c for runs in cpu.values() for _, by in runs for c in by},
        key=lambda c: -max(statistics.median(by.get(c, 0.0) for _, by in r) for r in cpu.values()),
    )
    med = {
        k: {c: statistics.median(by.get(c, 0.0) for _, by in r) for c in cats}
        for k, r in cpu.items()
    }
    lines = [
        "",
        "### Where the node's CPU goes in epoch 0 (local, 4 ranks; perf)",
        "",
        "`perf record -a -g` on every CPU while the 4 ranks read epoch 0 (tools/perf_epoch.py; "
        "each sample put in a category by the functions on its stack), CPU seconds, medians "
        f"of {reps} interleaved runs; windows/s are under perf. 2 CPUs x the epoch's length is "
        "what the node had.",
        "",
        "| | " + " | ".join(cpu) + " | difference |",
        "|---|" + "---|" * (len(cpu) + 1),
        "| windows/s | "
        + " | ".join(f"{statistics.median(w for w, _ in r):,.0f}" for r in cpu.values())
        + " | |",
    ]
    for c in [*cats, "total"]:
        vals = [sum(m.values()) if c == "total" else m[c] for m in med.values()]
        diff = vals[-1] - vals[0]
        lines.append(f"| {c} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {diff:+.2f} |")
    return lines


NFS = {"latency": 0.001, "bandwidth": 1e9}  # as in tools/bench.py
S3 = {"latency": 0.020, "bandwidth": 100e6}
#: section -> (label, RAM fraction, ranks, modelled origin); "none" is each one's reference
SECTIONS: dict[str, list[tuple[str, float, int, dict[str, float] | None]]] = {
    "local, 1 rank": [(k, f, 1, None) for k, f in BUDGETS.items()],
    "local, 4 ranks": [(k, f, 4, None) for k, f in BUDGETS.items()],
    "NFS-like cold, 1 rank": [("none", 0.0, 1, NFS), ("RAM 1.0 + SSD", 1.0, 1, NFS)],
    "NFS-like cold, 4 ranks": [("none", 0.0, 4, NFS), ("RAM 1.0 + SSD", 1.0, 4, NFS)],
    "S3-like cold, 1 rank": [("none", 0.0, 1, S3), ("RAM 1.0 + SSD", 1.0, 1, S3)],
    "S3-like cold, 4 ranks": [("none", 0.0, 4, S3), ("RAM 1.0 + SSD", 1.0, 4, S3)],
}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--work", default="bench-data/first-epoch")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--docs", default="docs")
    p.add_argument("--only", default="", help="only the sections whose name has this")
    p.add_argument(
        "--ram-dir",
        default="",
        help="a directory on the tmpfs for the RAM tier (default /dev/shm), e.g. one "
        "mounted with huge=within_size",
    )
    p.add_argument(
        "--perf-reps", type=int, default=3, help="epoch 0 under perf, per configuration (0: none)"
    )
    args = p.parse_args()
    sections = {k: v for k, v in SECTIONS.items() if args.only in k}
    if args.ram_dir:
        os.environ["ZSTORE_PROFILE_RAM_DIR"] = args.ram_dir
    store = prepare(Path(args.work))
    runs: dict[str, dict[str, list[list[tuple[float, float, float]]]]] = {
        sec: {label: [] for label, *_ in configs} for sec, configs in sections.items()
    }
    for sec, configs in sections.items():
        # The first run after a change of section read slower, whichever configuration
        # it was (local, 4 ranks: epoch 0 at 130-194 windows/s in 7 of 8 repetitions,
        # against 185-373 for the same configurations later in the section): it runs
        # once more first and is not counted.
        _, fraction, ranks, origin = configs[0]
        print(sec, "(not counted)", epochs(store, fraction, ranks, origin), flush=True)
        for label, fraction, ranks, origin in in_turn(configs, args.reps):
            runs[sec][label].append(epochs(store, fraction, ranks, origin))
            print(sec, label, runs[sec][label][-1], flush=True)
    cpu = where_cpu_goes(store, args.perf_reps)
    profiles = {"RAM tier 1.0x": profile(store, 1.0), "no RAM tier": profile(store, 0.0)}
    cache_config(0.0)  # removes the tiers
    med = {
        sec: {
            k: [statistics.median(r[e][0] for r in v) for e in range(EPOCHS)]
            + [statistics.median(r[0][1] for r in v)]
            + [statistics.median(r[0][2] for r in v), max(r[0][2] for r in v)]
            for k, v in by.items()
        }
        for sec, by in runs.items()
    }
    lines = [
        MARK_BEGIN,
        "",
        "## The first epoch (tools/profile_first_epoch.py)",
        "",
        "32 items of 15-45 s (~480 MB decoded); `WindowLoader(batch_size=16)`, 4 random "
        "10 s windows per item (128 per epoch), shuffled; every configuration in spawned "
        "processes of its own on one fresh node cache (ranks: `DistributedSampler`, "
        "windows/s for the node, the slowest rank's first batch). Local: page-cached "
        "origin, RAM tier only. Cold: the "
        "latency-modelled origin (`zstore.testing`; NFS-like 1 ms, 1 GB/s; S3-like 20 ms, "
        "100 MB/s per request) with a RAM tier of the whole data and an SSD tier, against "
        f"no tiers. Medians of {args.reps} interleaved repetitions per section, each "
        "configuration first in turn, after one run that is not counted. Kernel s: the "
        "ranks' system CPU time in epoch 0 (median, and the largest of the runs); on this "
        "virtual machine a run now and then spends 1-3 s there on first touches of fresh "
        "memory, in any configuration, and that run's epoch 0 falls to 50-100 windows/s "
        '(docs/benchmarks-notes.md, "Kernel time decides the medians").',
    ]
    for sec, by in med.items():
        none = by["none"]
        lines += [
            "",
            f"### {sec}",
            "",
            "| tiers | epoch 0 windows/s | vs none | epoch 0 kernel s (max) | "
            + "".join(f"epoch {e} | " for e in range(1, EPOCHS))
            + "vs none | first batch, ms | vs none |",
            "|---|---|---|---|" + "---|" * (EPOCHS - 1) + "---|---|---|",
        ]
        last = EPOCHS - 1
        for k, row in by.items():
            e0, first, kernel, kernel_max = row[0], row[EPOCHS], row[EPOCHS + 1], row[EPOCHS + 2]
            later = " | ".join(f"{row[e]:,.0f}" for e in range(1, EPOCHS))
            lines.append(
                f"| {k} | {e0:,.0f} | {e0 / none[0]:.2f}x | {kernel:.2f} ({kernel_max:.2f}) | "
                f"{later} | {row[last] / none[last]:.2f}x | {first * 1e3:.0f} | "
                f"{first / none[EPOCHS]:.2f}x |"
            )
    lines += cpu_lines(cpu, args.perf_reps)
    lines += [
        "",
        "Epoch 0 read window by window in one thread under cProfile (seconds spent in each "
        "function itself, top 10; with a RAM tier the fills run in the background thread, "
        "which this does not see):",
        "",
    ]
    for name, prof in profiles.items():
        lines.append(
            f"- {name}: {prof['windows'] / prof['seconds']:,.0f} windows/s; "
            + ", ".join(f"`{f}` {t:.3f} s" for f, t in prof["top"])
        )
    lines += ["", MARK_END]
    replace_section(args.docs, MARK_BEGIN, MARK_END, "\n".join(lines))
    with open(os.path.join(args.docs, "benchmarks-first-epoch.json"), "w") as f:
        json.dump({"runs": runs, "medians": med, "profiles": profiles, "cpu": cpu}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
