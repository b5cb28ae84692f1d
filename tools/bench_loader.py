"""The training loop: batches of 16 windows consumed by a loop that sums every batch.

    python tools/bench_loader.py               # uses ./bench-data/budget (tools/bench_budget.py)

Contenders, same dataset, same windows, in one run: zstore.WindowLoader; torch's
DataLoader with 0 and 2 workers over the same WindowDataset; a plain loop over ds[i];
h5py hyperslab reads in a DataLoader with 2 workers.  Warm (decoded RAM tier holding
the data) with 1 rank and 4 ranks on the node, and cold from the S3-like latency model
(20 ms a request, 100 MB/s a stream).  Each section starts with one run that is not
counted, then runs the contenders interleaved, each one first in turn.  Writes the
section "Training loop" of docs/benchmarks.md and docs/benchmarks-loader.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

import torch

from zstore.testing import spawn_ranks

BATCH = 16
EPOCHS = 2  # the first maps the tier's shards and makes the loaders' buffers; the table
# reports the second, as a training run spends most epochs
BUDGET_S = 40.0  # a slow contender stops after this long (windows/s stays comparable)
S3 = {"latency": 0.020, "bandwidth": 100e6}
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_docs import in_turn, replace_section  # noqa: E402

MARK_BEGIN = "<!-- training loop: begin (tools/bench_loader.py) -->"
MARK_END = "<!-- training loop: end -->"


class H5Windows(torch.utils.data.Dataset):
    """The same windows as a WindowDataset, read with h5py hyperslabs (opened per worker)."""

    def __init__(self, h5: str, ds: Any):
        self.h5, self.located = h5, [ds.locate(i) for i in range(len(ds))]
        self._f: Any = None  # opened in the worker that reads

    def __len__(self) -> int:
        return len(self.located)

    def __getitem__(self, i: int) -> dict[str, Any]:
        import h5py

        if self._f is None:
            self._f = h5py.File(self.h5, "r")
        item, spans, start, length = self.located[i]
        g = self._f[item]
        return {
            "wav": torch.from_numpy(g["wav"][:, spans["wav"].start : spans["wav"].stop]),
            "act": torch.from_numpy(g["act"][:, spans["act"].start : spans["act"].stop]),
            "length": length,
        }

    def __getstate__(self) -> dict[str, Any]:
        return {"h5": self.h5, "located": self.located, "_f": None}


def make_dataset(store: str, cache: Any, origin_fs: Any = None, per_item: int = 1) -> Any:
    import zstore

    return zstore.WindowDataset(
        store,
        window_seconds=10.0,
        seed=0,
        cache=cache,
        origin_fs=origin_fs,
        windows_per_item=per_item,
    )


def loader_for(kind: str, ds: Any, h5: str, sampler: Any) -> Any:
    import zstore

    if kind == "WindowLoader":
        return zstore.WindowLoader(ds, BATCH, sampler=sampler, threads=2, prefetch=2)
    if kind == "h5py DataLoader x2":
        return torch.utils.data.DataLoader(
            H5Windows(h5, ds), batch_size=BATCH, sampler=sampler, num_workers=2
        )
    workers = int(kind.rsplit("x", 1)[1])
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=workers)


def consume(
    kind: str, ds: Any, h5: str, sampler: Any, limit: int, barrier: Any
) -> list[tuple[int, float]]:
    """Windows consumed and seconds in each of EPOCHS epochs (the ranks start each epoch
    together): every batch summed, like a training step touching it.  A loader is made
    once and used for every epoch, as a training loop does."""
    loader = None if kind == "plain loop" else loader_for(kind, ds, h5, sampler)
    out = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        ds.set_epoch(epoch)
        barrier.wait()
        t0 = time.perf_counter()
        n = 0
        if loader is None:
            for i in sampler:
                x = ds[i]
                float(x["wav"].sum()) + float(x["act"].sum())
                n += 1
                if n >= limit or time.perf_counter() - t0 > BUDGET_S:
                    break
        else:
            for batch in loader:
                float(batch["wav"].sum()) + float(batch["act"].sum())
                n += batch["wav"].shape[0]
                if n >= limit or time.perf_counter() - t0 > BUDGET_S:
                    break
        out.append((n, time.perf_counter() - t0))
    return out


def rank(
    kind: str,
    store: str,
    h5: str,
    cache: Any,
    r: int,
    ranks: int,
    limit: int,
    origin: dict[str, Any] | None,
    step_threads: int | None,
    barrier: Any,
    queue: Any,
) -> None:
    from torch.utils.data.distributed import DistributedSampler

    if step_threads:
        torch.set_num_threads(step_threads)
    fs = None
    if origin:
        from zstore.testing import ModelledFileSystem

        fs = ModelledFileSystem(**origin)
    items = len(make_dataset(store, False))
    ds = make_dataset(store, cache, fs, per_item=-(-limit * ranks // items))
    sampler: Any = DistributedSampler(ds, num_replicas=ranks, rank=r, shuffle=True, seed=1)
    queue.put(consume(kind, ds, h5, sampler, limit, barrier))


def run(
    kind: str,
    store: str,
    h5: str,
    cache: Any,
    ranks: int,
    limit: int,
    origin: dict[str, Any] | None = None,
    step_threads: int | None = 1,
) -> list[float]:
    """Windows/s of the node in each epoch: ``ranks`` fresh processes, each reading
    ``limit`` windows an epoch (the dataset draws enough windows per item for that) and
    running the step on ``step_threads`` torch threads (None: torch's default)."""
    results = spawn_ranks(
        rank,
        ranks,
        lambda r, b, q: (kind, store, h5, cache, r, ranks, limit, origin, step_threads, b, q),
        timeout=3600,
    )
    return [sum(r[e][0] for r in results) / max(r[e][1] for r in results) for e in range(EPOCHS)]


def main() -> None:
    import zstore

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="bench-data/budget")
    p.add_argument("--windows", type=int, default=960, help="windows per node, warm")
    p.add_argument("--cold-windows", type=int, default=64, help="windows per rank, cold")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--docs", default="docs")
    args = p.parse_args()
    work = os.path.abspath(args.work)
    store, h5 = os.path.join(work, "speech.zarr"), os.path.join(work, "speech.h5")
    if not os.path.exists(store):
        sys.exit("run tools/bench_budget.py first (it makes the data)")
    ram = f"/dev/shm/zstore-bench-loader-{os.getuid()}"
    warm = zstore.CacheConfig(
        ram_dir=ram,
        ram_bytes="2GB",
        ram_format="decoded",
        ssd_dir=os.path.join(work, "ssd-loader"),
        ssd_bytes="2GB",
    )
    zstore.warm(store, cache=warm, progress=False, workers=2)
    kinds = ["WindowLoader", "DataLoader x0", "DataLoader x2", "plain loop", "h5py DataLoader x2"]
    results: dict[str, Any] = {"warm": {}, "cold": {}}
    # The training step runs on one torch thread (torchrun's default for several ranks
    # per node; a GPU step leaves the cores to the data), and once with torch's default
    # threads on every core for one rank, for comparison.
    # Each section starts with one run that is not counted, then runs its contenders
    # interleaved, each one first in turn: on this virtual machine the first run after a
    # change read slower whichever configuration it was (docs/benchmarks-notes.md, "The
    # tool's own order and process").
    for ranks, step_threads, label in ((1, 1, ""), (4, 1, ""), (1, None, ", step on every core")):
        n = args.windows // ranks
        run(kinds[0], store, h5, warm, ranks, n, step_threads=step_threads)  # not counted
        runs: dict[str, list[list[float]]] = {kind: [] for kind in kinds}
        for kind in in_turn(kinds, args.reps):
            runs[kind].append(run(kind, store, h5, warm, ranks, n, step_threads=step_threads))
            print(
                f"warm {ranks} rank(s){label} {kind:20s} windows/s by epoch {runs[kind][-1]}",
                flush=True,
            )
        for kind in kinds:
            results["warm"][f"{kind}, {ranks} rank(s){label}"] = runs[kind]

    def cold(kind: str) -> list[float]:
        """Windows/s by epoch of one rank reading the S3-like origin through a fresh SSD tier."""
        ssd = os.path.join(work, "cold-loader")
        shutil.rmtree(ssd, ignore_errors=True)
        cfg = zstore.CacheConfig(ram_dir=None, ssd_dir=ssd, ssd_bytes="2GB")
        return run(kind, store, h5, cfg, 1, args.cold_windows, S3)

    cold_kinds = ["WindowLoader", "DataLoader x2"]
    cold(cold_kinds[0])  # not counted
    results["cold"] = {kind: [] for kind in cold_kinds}
    for kind in in_turn(cold_kinds, args.reps):
        results["cold"][kind].append(cold(kind))
        print(f"cold S3-like {kind:20s} windows/s by epoch {results['cold'][kind][-1]}", flush=True)
    shutil.rmtree(ram, ignore_errors=True)
    write(results, args.docs)


def write(results: dict[str, Any], docs: str) -> None:
    with open(os.path.join(docs, "benchmarks-loader.json"), "w") as f:
        json.dump(results, f, indent=1)
    best = {k: max(r[-1] for r in v) for k, v in results["warm"].items()}
    cold = {k: max(r[0] for r in v) for k, v in results["cold"].items()}  # the cold epoch
    lines = [
        MARK_BEGIN,
        "",
        "## Training loop (tools/bench_loader.py)",
        "",
        f"Batches of {BATCH} random 10 s windows (8 mics), each summed by the loop; the "
        "decoded RAM tier holds the data (warm), or every read goes to the S3-like "
        "model (cold, one rank: its first epoch). Warm: windows/s for the node in the "
        "epoch after the first (the first maps the tier's shards into each fresh "
        "process and makes the loaders' buffers; per-epoch numbers are in "
        "docs/benchmarks-loader.json), best of the repetitions.",
        "",
        "The training step (the sum) runs on one torch thread in each process, "
        "as torchrun sets it for several ranks per node and as a GPU step leaves the "
        "cores to the data; the last column runs it on torch's default threads (both "
        "cores), where torch's OpenMP threads spin after each step on the cores the "
        "loader's threads copy on.",
        "",
        "| reader | 1 rank | 4 ranks | 1 rank, step on every core |",
        "|---|---:|---:|---:|",
    ]
    for kind in (
        "WindowLoader",
        "DataLoader x0",
        "DataLoader x2",
        "plain loop",
        "h5py DataLoader x2",
    ):
        lines.append(
            f"| {kind} | {best[f'{kind}, 1 rank(s)']:.0f} | "
            f"{best[f'{kind}, 4 rank(s)']:.0f} | "
            f"{best[f'{kind}, 1 rank(s), step on every core']:.0f} |"
        )
    lines += [
        "",
        f"Cold, S3-like: WindowLoader {cold['WindowLoader']:.0f} windows/s, "
        f"DataLoader x2 {cold['DataLoader x2']:.0f}.",
        "",
        "| target | measured | met |",
        "|---|---:|:---:|",
    ]
    for name, value, goal in (
        (
            "warm: WindowLoader >= 5x DataLoader x2 (1 rank)",
            best["WindowLoader, 1 rank(s)"] / best["DataLoader x2, 1 rank(s)"],
            5.0,
        ),
        (
            "warm: WindowLoader >= 1.2x the plain loop (1 rank)",
            best["WindowLoader, 1 rank(s)"] / best["plain loop, 1 rank(s)"],
            1.2,
        ),
        (
            "cold S3-like: WindowLoader >= 2x DataLoader x2",
            cold["WindowLoader"] / cold["DataLoader x2"],
            2.0,
        ),
    ):
        lines.append(f"| {name} | {value:.2f} | {'yes' if value >= goal else 'NO'} |")
    every = (
        best["WindowLoader, 1 rank(s), step on every core"]
        / best["plain loop, 1 rank(s), step on every core"]
    )
    lines += [
        "",
        f"With the step on every core, WindowLoader reads {every:.2f}x the plain loop (1 rank).",
        "",
        MARK_END,
    ]
    replace_section(docs, MARK_BEGIN, MARK_END, "\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
