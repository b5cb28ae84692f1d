"""The first epoch of a corpus of short utterances, with and without a RAM tier.

    python tools/bench_short_first_epoch.py              # 50,000 utterances, ~4 min
    python tools/bench_short_first_epoch.py --items 20000 --reps 5

A corpus shaped like transcribed speech (LibriSpeech, Common Voice): N utterances of
0.25-1 s, int16 at 16 kHz under 500 speaker groups, each with a ``text`` string dataset
and a ``speaker`` attribute, written by h5py and converted by ``zstore.convert``
(packed).  One process reads ``WindowLoader(batch_size=64, shuffle=True)`` over 0.5 s
windows, epochs 0 to 2 of N windows each, in a fresh process per configuration:

- no RAM tier;
- a RAM tier that holds the decoded data (``ram_format="auto"``: whole decoded shards
  for packed items) with the fills behind the reads in a process of their own
  (``fills="process"``, what ``"auto"`` picks for one process on this machine) and in
  a thread of the reading process (``fills="thread"``);
- the same budget with ``ram_format="chunks"`` (the reads fill decoded chunks).

Configurations are interleaved, each first in turn, ``--reps`` times; medians.  Writes
the section "The first epoch of short utterances" of docs/benchmarks.md and
docs/benchmarks-short-first-epoch.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_docs import in_turn, replace_section  # noqa: E402

MARK_BEGIN = "<!-- short first epoch: begin (tools/bench_short_first_epoch.py) -->"
MARK_END = "<!-- short first epoch: end -->"
EPOCHS = 3
#: label -> CacheConfig arguments (None: no tier)
CONFIGS: dict[str, dict[str, str] | None] = {
    "none": None,
    "RAM, fills in a process": {"fills": "process"},
    "RAM, fills in a thread": {"fills": "thread"},
    "RAM, chunks": {"ram_format": "chunks"},
}


def make_corpus(work: Path, n: int) -> Path:
    """The HDF5 file of ``n`` utterances and its store (made once per size)."""
    import h5py
    import numpy as np

    import zstore

    work.mkdir(parents=True, exist_ok=True)
    h5, store = work / f"utt{n}.h5", work / f"utt{n}.zarr"
    if store.exists():
        return store
    rng = np.random.default_rng(0)
    with h5py.File(h5, "w") as f:
        for i in range(n):
            g = f.create_group(f"spk{i % 500:03d}/u{i:06d}")
            samples = int(rng.integers(4000, 16000))
            g["wav"] = (rng.standard_normal((1, samples)) * 3000).astype(np.int16)
            g["text"] = f"utterance {i} words " * 3
            g.attrs["speaker"] = f"spk{i % 500:03d}"
    zstore.convert(h5, store, rates={"wav": 16000}, overwrite=True)
    h5.unlink()
    return store


def one(store: str, label: str, ram_dir: str) -> dict[str, object]:
    """Epochs 0 to 2 of one configuration, in this (fresh) process."""
    import warnings

    import zstore

    warnings.simplefilter("ignore")  # the padding of utterances under 0.5 s
    args = CONFIGS[label]
    shutil.rmtree(ram_dir, ignore_errors=True)
    cache = (
        False
        if args is None
        else zstore.CacheConfig(ram_dir=ram_dir, ram_bytes="4GB", ssd_dir=None, **args)
    )
    ds = zstore.WindowDataset(store, window_seconds=0.5, cache=cache, seed=0)
    loader = zstore.WindowLoader(ds, batch_size=64, shuffle=True)
    rates, first = [], 0.0
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        t0, n = time.perf_counter(), 0
        for batch in loader:
            n += batch["wav"].shape[0]
            if epoch == 0 and not first:
                first = time.perf_counter() - t0
        rates.append(n / (time.perf_counter() - t0))
    ds.settle(120)
    shutil.rmtree(ram_dir, ignore_errors=True)
    return {"rates": rates, "first": first}


def run(store: Path, label: str, ram_dir: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, __file__, "--one", label, "--store", str(store), "--ram-dir", ram_dir],
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(runs: dict[str, list[dict]], n: int, reps: int) -> list[str]:
    def med(label: str, f) -> float:
        return statistics.median(f(r) for r in runs[label])

    base0 = med("none", lambda r: r["rates"][0])
    first0 = med("none", lambda r: r["first"])
    lines = [
        f"{n:,} packed utterances of 0.25-1 s (int16 at 16 kHz, a transcript and a speaker "
        "each), one process, `WindowLoader(batch_size=64, shuffle=True)`, 0.5 s windows, "
        f"epochs of {n:,} windows; RAM tier of the whole data, no SSD tier; each "
        f"configuration in a fresh process, medians of {reps} interleaved repetitions "
        "(windows/s; first batch of epoch 0 in ms).",
        "",
        "| RAM tier | epoch 0 | vs none | epoch 1 | epoch 2 | vs none | first batch | vs none |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base2 = med("none", lambda r: r["rates"][2])
    for label in CONFIGS:
        e = [med(label, lambda r, i=i: r["rates"][i]) for i in range(EPOCHS)]
        first = med(label, lambda r: r["first"])
        lines.append(
            f"| {label} | {e[0]:,.0f} | {e[0] / base0:.2f}x | {e[1]:,.0f} | {e[2]:,.0f} | "
            f"{e[2] / base2:.2f}x | {1000 * first:.0f} | {first / first0:.2f}x |"
        )
    spread = {label: [round(r["rates"][0]) for r in runs[label]] for label in CONFIGS}
    lines += [
        "",
        "Epoch 0 of each repetition: "
        + "; ".join(f"{label} {', '.join(f'{x:,}' for x in xs)}" for label, xs in spread.items())
        + ".",
    ]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--items", type=int, default=50_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "zstore-short-first"))
    p.add_argument("--docs", default=os.path.join(os.path.dirname(__file__), "..", "docs"))
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--ram-dir", default="/dev/shm/zstore-short-first-epoch")
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.store, args.one, args.ram_dir)))
        return
    store = make_corpus(Path(args.work), args.items)
    runs: dict[str, list[dict]] = {label: [] for label in CONFIGS}
    print("(not counted)", run(store, "none", args.ram_dir), flush=True)
    for label in in_turn(list(CONFIGS), args.reps):
        runs[label].append(run(store, label, args.ram_dir))
        print(label, runs[label][-1], flush=True)
    lines = table(runs, args.items, args.reps)
    print("\n".join(lines))
    docs = Path(args.docs)
    (docs / "benchmarks-short-first-epoch.json").write_text(
        json.dumps({"items": args.items, "reps": args.reps, "runs": runs}, indent=1) + "\n"
    )
    section = "\n".join(
        [
            MARK_BEGIN,
            "## The first epoch of short utterances (tools/bench_short_first_epoch.py)",
            "",
            *lines,
            MARK_END,
        ]
    )
    replace_section(str(docs), MARK_BEGIN, MARK_END, section)


if __name__ == "__main__":
    main()
