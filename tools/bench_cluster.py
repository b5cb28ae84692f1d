"""A simulated cluster: node-stable sampling against DistributedSampler.

    python tools/bench_cluster.py        # uses ./bench-data/budget (tools/bench_budget.py's
                                         # corpus; made first when it is not there)

4 nodes x 2 ranks as 8 processes on this machine; each node has its own RAM tier of
0.35x the decoded corpus (a node's share fits, the corpus does not) and no SSD tier; the
store is read through the S3-like latency model (20 ms a request, 100 MB/s a stream).
4 epochs of 4 windows per item each.  Per epoch and sampler: bytes read from the
origin (all nodes), RAM hit rate and windows/s.  Writes the section "Cluster" of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_docs import replace_section  # noqa: E402

NODES, PER_NODE = 4, 2
S3 = {"latency": 0.020, "bandwidth": 100e6}
MARK_BEGIN = "<!-- cluster: begin (tools/bench_cluster.py) -->"
MARK_END = "<!-- cluster: end -->"


def cache_for(work: str, node: int, budget: int) -> Any:
    import zstore

    return zstore.CacheConfig(
        ram_dir=f"/dev/shm/zstore-bench-cluster-{os.getuid()}/node{node}",
        ram_bytes=budget,
        ssd_dir=None,
    )


def rank(
    kind: str, store: str, work: str, budget: int, r: int, epochs: int, barrier: Any, queue: Any
) -> None:
    import torch

    import zstore
    from zstore.testing import ModelledFileSystem

    node = r // PER_NODE
    ds = zstore.WindowDataset(
        store,
        window_seconds=10.0,
        seed=0,
        windows_per_item=4,
        cache=cache_for(work, node, budget),
        origin_fs=ModelledFileSystem(latency=S3["latency"], bandwidth=S3["bandwidth"]),
    )
    world = NODES * PER_NODE
    sampler: Any
    if kind == "distributed":
        sampler = torch.utils.data.distributed.DistributedSampler(
            ds, num_replicas=world, rank=r, shuffle=True, seed=0
        )
    else:
        rotate = float(kind.split("=")[1]) if "=" in kind else 0.0
        sampler = zstore.NodeSampler(
            ds, num_replicas=world, rank=r, local_world_size=PER_NODE, seed=0, rotate=rotate
        )
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        ds.set_epoch(epoch)
        barrier.wait()
        t0 = time.perf_counter()
        n = 0
        for index in sampler:
            ds[index]
            n += 1
        queue.put((epoch, r, n, time.perf_counter() - t0))
        barrier.wait()


def node_counts(work: str, budget: int) -> dict[str, int]:
    from zstore.cache._stats import read_stats
    from zstore.cache.tiered import node_dir

    total: dict[str, int] = {}
    for node in range(NODES):
        stats = read_stats(node_dir(cache_for(work, node, budget).resolved(), "stats"))
        for k, v in stats.items():
            total[k] = total.get(k, 0) + v
    return total


def run(kind: str, store: str, work: str, budget: int, epochs: int) -> dict[str, Any]:
    shutil.rmtree(f"/dev/shm/zstore-bench-cluster-{os.getuid()}", ignore_errors=True)
    ctx = mp.get_context("spawn")
    world = NODES * PER_NODE
    barrier, queue = ctx.Barrier(world + 1), ctx.Queue()
    procs = [
        ctx.Process(target=rank, args=(kind, store, work, budget, r, epochs, barrier, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[str, Any] = {
        "sampler": kind,
        "origin_bytes": [],
        "ram_hit_rate": [],
        "windows_per_s": [],
    }
    last = node_counts(work, budget)
    for _ in range(epochs):
        barrier.wait()
        reports = [queue.get(timeout=3600) for _ in procs]
        barrier.wait()
        now = node_counts(work, budget)
        delta = {k: now[k] - last.get(k, 0) for k in now}
        last = now
        looked = delta["ram_hits"] + delta["ram_misses"]
        out["origin_bytes"].append(delta["origin_bytes"])
        out["ram_hit_rate"].append(delta["ram_hits"] / looked if looked else 0.0)
        out["windows_per_s"].append(sum(r[2] for r in reports) / max(r[3] for r in reports))
    for p in procs:
        p.join(600)
    shutil.rmtree(f"/dev/shm/zstore-bench-cluster-{os.getuid()}", ignore_errors=True)
    return out


def main() -> None:
    from zstore.format import read_manifest
    from zstore.format.sizing import field_sizes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="bench-data/budget")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--docs", default="docs")
    p.add_argument(
        "--replot",
        action="store_true",
        help="rewrite the section and plot from docs/benchmarks-cluster.json",
    )
    args = p.parse_args()
    work = os.path.abspath(args.work)
    store = os.path.join(work, "speech.zarr")
    if not os.path.exists(os.path.join(store, "zarr.json")):  # bench_budget.py's corpus
        from bench_budget import prepare

        print(f"{store} is not there yet: making tools/bench_budget.py's corpus (500MB)")
        prepare(work, "500MB")
    manifest, metas = read_manifest(store, None)
    sizes = field_sizes(manifest, metas)
    budget = int(0.35 * sizes.decoded_bytes)
    if args.replot:
        with open(os.path.join(args.docs, "benchmarks-cluster.json")) as f:
            write(json.load(f), sizes, budget, args.docs)
        return
    results = []
    for kind in ("node", "node rotate=0.1", "distributed"):
        r = run(kind, store, work, budget, args.epochs)
        results.append(r)
        print(json.dumps(r), flush=True)
    write(results, sizes, budget, args.docs)


def write(results: list[dict[str, Any]], sizes: Any, budget: int, docs: str) -> None:
    with open(os.path.join(docs, "benchmarks-cluster.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = [
        MARK_BEGIN,
        "",
        "## Cluster: node-stable sampling (tools/bench_cluster.py)",
        "",
        f"{NODES} simulated nodes x {PER_NODE} ranks (8 processes), each node its own "
        f"RAM tier of {budget / 1e6:.0f} MB (0.35x the {sizes.decoded_bytes / 1e6:.0f} MB "
        "decoded corpus) and no SSD tier, the store behind the S3-like model; 4 windows "
        "per item per epoch.",
        "",
        "| sampler | origin MB by epoch | RAM hit rate by epoch | windows/s by epoch |",
        "|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['sampler']} | "
            + ", ".join(f"{b / 1e6:.0f}" for b in r["origin_bytes"])
            + " | "
            + ", ".join(f"{h:.0%}" for h in r["ram_hit_rate"])
            + " | "
            + ", ".join(f"{w:.0f}" for w in r["windows_per_s"])
            + " |"
        )
    node = results[0]
    later = max(node["origin_bytes"][1:]) / max(1, node["origin_bytes"][0])
    lines += [
        "",
        "| target | measured | met |",
        "|---|---:|:---:|",
        f"| NodeSampler: origin bytes in each later epoch <= 2% of epoch 0's | "
        f"{later:.1%} | {'yes' if later <= 0.02 else 'NO'} |",
        "",
        f"Sizing: with M nodes of RAM budget B, the corpus the cluster keeps warm is "
        f"about M x B of its RAM form, where int16 samples take half their float bytes "
        f"(here {NODES} x {budget / 1e6:.0f} MB against {sizes.decoded_bytes / 1e6:.0f} MB "
        f"decoded, {(sizes.ram_bytes or sizes.decoded_bytes) / 1e6:.0f} MB in RAM).",
        "",
        MARK_END,
    ]
    replace_section(docs, MARK_BEGIN, MARK_END, "\n".join(lines))
    plot(results, os.path.join(docs, "benchmarks-cluster.png"))


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Origin bytes per epoch, one line per sampler."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        ax.plot(
            range(len(r["origin_bytes"])),
            [b / 1e6 for b in r["origin_bytes"]],
            marker="o",
            label=r["sampler"],
        )
    ax.set_xlabel("epoch")
    ax.set_ylabel("MB read from the origin (all nodes)")
    ax.set_title(f"{NODES} nodes x {PER_NODE} ranks, node RAM 0.35x the corpus")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
