"""Where the first epoch's time goes: one process, with and without a RAM tier.

    python tools/profile_first_epoch.py          # ~460 MB of synthetic HDF5 under ./bench-data/first-epoch

The speech store of issue #28 (32 items of 15-45 s, ~480 MB decoded), no SSD tier,
local page-cached origin.  Part 1: ``WindowLoader(batch_size=16, shuffle=True)`` over
``windows_per_item=4`` random 10 s windows, epochs 0 and 1, with no RAM tier and with a
RAM tier of 1.0, 0.5 and 0.33x the decoded bytes, ``--reps`` interleaved repetitions
(windows/s and time to the first batch).  Part 2: epoch 0 read window by window in this
thread under cProfile, with a RAM tier that holds the data and without one: the
functions that take the time.  Writes the section "The first epoch" of
docs/benchmarks.md and docs/benchmarks-first-epoch.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_docs import replace_section  # noqa: E402

MARK_BEGIN = "<!-- first epoch: begin (tools/profile_first_epoch.py) -->"
MARK_END = "<!-- first epoch: end -->"
DECODED = 480e6
BUDGETS = {"none": 0.0, "1.0": 1.0, "0.5": 0.5, "0.33": 0.33}


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
    return "/dev/shm/zstore-first-epoch" if os.path.isdir("/dev/shm") else "/tmp/zstore-fe"


def dataset(store: str, fraction: float) -> Any:
    import zstore

    shutil.rmtree(ram_dir(), ignore_errors=True)
    cache: Any = (
        zstore.CacheConfig(ram_dir=ram_dir(), ram_bytes=int(DECODED * fraction))
        if fraction
        else False
    )
    return zstore.WindowDataset(store, window_seconds=10.0, windows_per_item=4, cache=cache)


def epochs(store: str, fraction: float) -> list[tuple[float, float]]:
    """(windows/s, seconds to the first batch) of epochs 0 and 1."""
    import zstore

    loader = zstore.WindowLoader(dataset(store, fraction), batch_size=16, shuffle=True)
    out = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        t0, n, first = time.perf_counter(), 0, 0.0
        for batch in loader:
            n += batch["wav"].shape[0]
            first = first or time.perf_counter() - t0
        out.append((n / (time.perf_counter() - t0), first))
    return out


def profile(store: str, fraction: float, top: int = 10) -> dict[str, Any]:
    ds = dataset(store, fraction)
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


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--work", default="bench-data/first-epoch")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--docs", default="docs")
    args = p.parse_args()
    store = prepare(Path(args.work))
    runs: dict[str, list[list[tuple[float, float]]]] = {k: [] for k in BUDGETS}
    for _ in range(args.reps):
        for label, fraction in BUDGETS.items():
            runs[label].append(epochs(store, fraction))
            print(label, runs[label][-1], flush=True)
    profiles = {"RAM tier 1.0x": profile(store, 1.0), "no RAM tier": profile(store, 0.0)}
    shutil.rmtree(ram_dir(), ignore_errors=True)
    med = {
        k: [statistics.median(r[e][0] for r in v) for e in range(2)]
        + [statistics.median(r[0][1] for r in v)]
        for k, v in runs.items()
    }
    lines = [
        MARK_BEGIN,
        "",
        "## The first epoch (tools/profile_first_epoch.py)",
        "",
        "One process, 32 items of 15-45 s (~480 MB decoded), no SSD tier, local "
        "page-cached origin; `WindowLoader(batch_size=16, shuffle=True)`, 4 random 10 s "
        f"windows per item (128 per epoch). Medians of {args.reps} interleaved repetitions.",
        "",
        "| RAM tier (x decoded) | epoch 0 windows/s | vs none | epoch 1 windows/s | "
        "first batch, ms | vs none |",
        "|---|---|---|---|---|---|",
    ]
    none = med["none"]
    for k, (e0, e1, first) in med.items():
        lines.append(
            f"| {k} | {e0:,.0f} | {e0 / none[0]:.2f}x | {e1:,.0f} | {first * 1e3:.0f} | "
            f"{first / none[2]:.2f}x |"
        )
    lines += [
        "",
        "Epoch 0 read window by window under cProfile (seconds spent in each function itself, top 10):",
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
        json.dump({"runs": runs, "medians": med, "profiles": profiles}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
