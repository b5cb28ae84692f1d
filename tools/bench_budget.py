"""Beyond the RAM budget: windows/s, RAM fills and hit rate against the RAM budget.

    python tools/bench_budget.py                  # ~500 MB decoded in ./bench-data/budget
    python tools/bench_budget.py --ranks 4 --epochs 3

For each RAM budget (a fraction of the decoded bytes of the fields read; the SSD tier
holds the whole store, warmed once) and each ``ram_format`` (the default and the
explicit ones), one process (or ``--ranks`` processes sharing the node's tiers) reads
the same random 10 s windows for ``--epochs`` epochs.  h5py's hyperslab and the
single-core decode limit (numcodecs on the window's chunks, already in memory) read the
same windows in the same run.  Each configuration runs ``--reps`` times, interleaved
(within each budget, each format first in turn), and the tables show the medians.
Writes docs/benchmarks-budget.json and the section "Beyond the RAM budget" of
docs/benchmarks.md, and docs/benchmarks-budget.png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time
from typing import Any

import numpy as np

HOP = 160
FRAMES = 1000  # 10 s at 100 frames/s
FRACTIONS = (1.0, 0.75, 0.5, 0.33, 0.0)
FORMATS = ("auto", "chunks", "decoded", "encoded")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_docs import replace_section  # noqa: E402

MARK_BEGIN = "<!-- budget sweep: begin (tools/bench_budget.py) -->"
MARK_END = "<!-- budget sweep: end -->"


def prepare(work: str, size: str) -> dict[str, Any]:
    import zstore
    from zstore.testing.synthetic import SyntheticSpec, items_for_size, make_synthetic
    from zstore.units import parse_size
    from zstore.urls import store_bytes

    os.makedirs(work, exist_ok=True)
    h5, store = os.path.join(work, "speech.h5"), os.path.join(work, "speech.zarr")
    meta_path = os.path.join(work, "prepared.json")
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
    if meta.get("size") != size or not os.path.exists(store):
        spec = SyntheticSpec(items=items_for_size(parse_size(size), SyntheticSpec(items=1)))
        make_synthetic(h5, spec, progress=True)
        zstore.convert(h5, store, rates={"wav": 16000, "act": 100}, overwrite=True)
        meta = {"size": size, "items": spec.items}
        json.dump(meta, open(meta_path, "w"))
    manifest = zstore.WindowReader(store, cache=None).open().manifest
    reader = zstore.WindowReader(store, cache=None).open()
    decoded = 0
    for name in ("wav", "act"):
        layout = reader.layout(manifest.items[0], name)
        per = int(np.prod(layout.shape)) // layout.length * layout.dtype.itemsize
        decoded += per * sum(manifest.lengths[name])
    return {
        "h5": h5,
        "store": store,
        "decoded_bytes": decoded,
        "store_bytes": store_bytes(store),
        "items": len(manifest.items),
    }


def draw(store: str, n: int, seed: int) -> list[tuple[str, int]]:
    import zstore

    manifest = zstore.WindowReader(store, cache=None).open().manifest
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        i = int(rng.integers(len(manifest.items)))
        length = manifest.lengths["act"][i]
        out.append((manifest.items[i], int(rng.integers(0, max(1, length - FRAMES + 1)))))
    return out


def spans(start: int) -> dict[str, Any]:
    from zstore.format import Span

    return {"wav": Span(start * HOP, (start + FRAMES) * HOP), "act": Span(start, start + FRAMES)}


def cache_config(work: str, budget: int, fmt: str) -> Any:
    import zstore

    return zstore.CacheConfig(
        ram_dir=os.path.join(work, "ram") if budget else None,
        ram_bytes=budget,
        ram_format=fmt,
        ssd_dir=os.path.join(work, "ssd"),
        ssd_bytes="4GB",
    )


def rank(
    store: str, config: Any, epochs: list[list[tuple[str, int]]], barrier: Any, queue: Any
) -> None:
    import zstore

    reader = zstore.WindowReader(store, cache=config).open()
    times = []
    for windows in epochs:
        barrier.wait()
        t0 = time.perf_counter()
        for item, start in windows:
            reader.read(item, spans(start))
        times.append(time.perf_counter() - t0)
        barrier.wait()
    queue.put(times)


def run_config(
    info: dict[str, Any],
    work: str,
    fraction: float,
    fmt: str,
    epochs: int,
    per_epoch: int,
    ranks: int,
) -> dict[str, Any]:
    import zstore

    budget = int(info["decoded_bytes"] * fraction)
    config = cache_config(work, budget, fmt)
    shutil.rmtree(os.path.join(work, "ram"), ignore_errors=True)
    stats_before = counters(config)
    plan = [draw(info["store"], per_epoch * ranks, seed=100 + e) for e in range(epochs)]
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(ranks + 1), ctx.Queue()
    procs = [
        ctx.Process(
            target=rank, args=(info["store"], config, [w[r::ranks] for w in plan], barrier, queue)
        )
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    per_epoch_stats = []
    last = stats_before
    for _ in range(epochs):
        barrier.wait()
        barrier.wait()
        now = counters(config)
        per_epoch_stats.append({k: now[k] - last.get(k, 0) for k in now})
        last = now
    times = [queue.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join(600)
    window_bytes = FRAMES * (HOP * 8 + 3) * 4
    out: dict[str, Any] = {
        "fraction": fraction,
        "format": fmt,
        "budget": budget,
        "ranks": ranks,
        "windows_per_s": [],
        "ram_fill_bytes": [],
        "ram_hit_rate": [],
        "read_bytes": [],
    }
    for e in range(epochs):
        seconds = max(t[e] for t in times)
        out["windows_per_s"].append(per_epoch * ranks / seconds)
        s = per_epoch_stats[e]
        out["ram_fill_bytes"].append(s.get("ram_fill_bytes", 0))
        hits, misses = s.get("ram_hits", 0), s.get("ram_misses", 0)
        out["ram_hit_rate"].append(hits / (hits + misses) if hits + misses else 0.0)
        out["read_bytes"].append(per_epoch * ranks * window_bytes)
    out["chosen"] = zstore.cache_stats(config).get("formats", {})
    return out


def rep_order(configs: list[tuple[int, float, str]], rep: int) -> list[tuple[int, float, str]]:
    """``configs`` in the order of repetition ``rep``: within each (ranks, budget), the
    formats rotated so that each one runs first in turn (the first run after the tier
    of the one before was deleted pays this machine's fresh-memory cost)."""
    out: list[tuple[int, float, str]] = []
    groups: dict[tuple[int, float], list[tuple[int, float, str]]] = {}
    for c in configs:
        groups.setdefault(c[:2], []).append(c)
    for group in groups.values():
        k = rep % len(group)
        out += group[k:] + group[:k]
    return out


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One run of medians, epoch by epoch, over the repetitions of a configuration."""
    out = dict(runs[0])
    for key in ("windows_per_s", "ram_fill_bytes", "ram_hit_rate", "read_bytes"):
        out[key] = [statistics.median(r[key][e] for r in runs) for e in range(len(runs[0][key]))]
    return out


def counters(config: Any) -> dict[str, int]:
    from zstore.cache._stats import read_stats
    from zstore.cache.tiered import node_dir

    return read_stats(node_dir(config.resolved(), "stats"))


def reference(info: dict[str, Any], windows: list[tuple[str, int]]) -> dict[str, float]:
    """h5py hyperslab (page-cached) and the single-core decode limit of the same windows."""
    import h5py

    import zstore
    from zstore.format.decode import decode_chunk

    with open(info["h5"], "rb") as raw:  # page-cached, as the stores are: read it once
        while raw.read(1 << 24):
            pass
    with h5py.File(info["h5"], "r") as f:
        for item, start in windows[:20]:
            f[item]["wav"][:, start * HOP : (start + FRAMES) * HOP]
        t0 = time.perf_counter()
        for item, start in windows:
            f[item]["wav"][:, start * HOP : (start + FRAMES) * HOP]
            f[item]["act"][:, start : start + FRAMES]
        h5 = len(windows) / (time.perf_counter() - t0)
    reader = zstore.WindowReader(info["store"], cache=None).open()
    encoded = []
    for item, start in windows:
        parts = []
        for name, span in spans(start).items():
            layout = reader.layout(item, name)
            need = [(layout, k) for k in layout.chunks_for(span.start, span.stop)]
            index = reader.source.index([(layout, k // layout.chunks_per_shard) for _, k in need])
            for _, k in need:
                obj = layout.object_key(k // layout.chunks_per_shard)
                off, n = index[obj][k % layout.chunks_per_shard]
                parts.append((layout, span, k, reader.origin.read(obj, int(off), int(off + n))))
        encoded.append(parts)
    t0 = time.perf_counter()
    for parts in encoded:
        outs: dict[str, np.ndarray] = {}
        for layout, span, k, data in parts:
            chunk = decode_chunk(layout, data, "bench")
            out = outs.get(layout.path)
            if out is None:
                shape = list(layout.shape)
                shape[-1] = span.stop - span.start
                out = outs[layout.path] = np.empty(shape, layout.dtype)
            lo, hi = max(span.start, k * layout.chunk), min(span.stop, (k + 1) * layout.chunk)
            out[..., lo - span.start : hi - span.start] = chunk[
                ..., lo - k * layout.chunk : hi - k * layout.chunk
            ]
    decode = len(encoded) / (time.perf_counter() - t0)
    return {"h5_slab": h5, "decode_limit": decode}


def hit_costs(
    info: dict[str, Any], work: str, windows: list[tuple[str, int]], decode_limit: float
) -> dict[str, float]:
    """Per-window time of warm encoded-RAM hits and of SSD hits (page-cached), against
    decode + one copy of the same windows (the decode limit)."""
    import zstore

    out = {"decode_copy_us": 1e6 / decode_limit}
    for label, ram in (("encoded_ram", True), ("ssd", False)):
        shutil.rmtree(os.path.join(work, "ram-hits"), ignore_errors=True)
        config = zstore.CacheConfig(
            ram_dir=os.path.join(work, "ram-hits") if ram else None,
            ram_bytes="2GB",
            ram_format="encoded",
            ssd_dir=os.path.join(work, "ssd"),
            ssd_bytes="4GB",
        )
        reader = zstore.WindowReader(info["store"], cache=config).open()
        for _ in range(2):  # build the shards, then map them
            for item, start in windows:
                reader.read(item, spans(start))
            reader.settle(timeout=600)  # the fills behind the reads are in
        best = []
        for _ in range(3):
            t0 = time.perf_counter()
            for item, start in windows:
                reader.read(item, spans(start))
            best.append((time.perf_counter() - t0) / len(windows) * 1e6)
        out[f"{label}_us"] = min(best)
        out[f"{label}_over_us"] = min(best) - out["decode_copy_us"]
    shutil.rmtree(os.path.join(work, "ram-hits"), ignore_errors=True)
    return out


def warm_ssd(info: dict[str, Any], work: str) -> None:
    import zstore

    config = cache_config(work, 0, "encoded")
    zstore.warm(info["store"], cache=config, progress=False, workers=2)


def _plain(value: Any) -> Any:
    """numpy scalars in the results (counts from numpy sums) as Python numbers."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def write(results: dict[str, Any], docs: str) -> None:
    with open(os.path.join(docs, "benchmarks-budget.json"), "w") as f:
        json.dump(results, f, indent=1, default=_plain)
    ref = results["reference"]
    lines = [
        MARK_BEGIN,
        "",
        "## Beyond the RAM budget (tools/bench_budget.py)",
        "",
        f"{results['items']} items, {results['decoded_bytes'] / 1e6:.0f} MB decoded, "
        f"{results['store_bytes'] / 1e6:.0f} MB stored; the SSD tier holds the whole "
        f"store (warmed once); random 10 s windows ({results['per_epoch']} per epoch per "
        f"rank), {results['epochs']} epochs; medians of {results.get('reps', 1)} "
        "interleaved repetitions per configuration (within each budget, each format "
        "first in turn), after one run per rank count that is not counted. Reference, same windows: h5py hyperslab "
        f"{ref['h5_slab']:.0f} windows/s, single-core decode limit "
        f"{ref['decode_limit']:.0f} windows/s.",
        "",
        "Per-window time of warm hits against decode + one copy of the same windows "
        f"({results['hits']['decode_copy_us']:.0f} us): an encoded RAM hit "
        f"{results['hits']['encoded_ram_us']:.0f} us "
        f"(+{results['hits']['encoded_ram_over_us']:.0f} us; target +300), an SSD hit "
        f"(page-cached) {results['hits']['ssd_us']:.0f} us "
        f"(+{results['hits']['ssd_over_us']:.0f} us; target +500).",
        "",
        "| ranks | RAM budget (x decoded) | ram_format | windows/s by epoch | "
        "RAM hit rate by epoch | RAM fills / bytes read by epoch | chosen |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        wps = ", ".join(f"{x:.0f}" for x in r["windows_per_s"])
        hit = ", ".join(f"{x:.0%}" for x in r["ram_hit_rate"])
        fill = ", ".join(f"{f / b:.2f}" for f, b in zip(r["ram_fill_bytes"], r["read_bytes"]))
        chosen = "; ".join(f"{v.get('format')}" for v in r.get("chosen", {}).values()) or "-"
        lines.append(
            f"| {r['ranks']} | {r['fraction']:.2f} | {r['format']} | {wps} | {hit} | "
            f"{fill} | {chosen} |"
        )
    lines += [
        "",
        "Targets, over every epoch after the first:",
        "",
        "| target | measured | met |",
        "|---|---:|:---:|",
    ]
    for name, value, goal, at_least in targets(results):
        met = value >= goal if at_least else value <= goal
        lines.append(f"| {name} | {value:.2f} | {'yes' if met else 'NO'} |")
    lines += ["", MARK_END]
    replace_section(docs, MARK_BEGIN, MARK_END, "\n".join(lines))
    _plot(results, os.path.join(docs, "benchmarks-budget.png"))


def targets(results: dict[str, Any]) -> list[tuple[str, float, float, bool]]:
    """(target, measured, goal, whether measured must be at least the goal) for the
    runs of the sweep, each taken at its worst epoch after the first."""
    runs = results["runs"]

    def wps(ranks: int, fraction: float, fmt: str) -> list[float]:
        for r in runs:
            if (r["ranks"], r["fraction"], r["format"]) == (ranks, fraction, fmt):
                return r["windows_per_s"][1:]
        return []

    default_vs_best, larger_vs_smaller, vs_decode, fills = [], [], [], []
    for ranks in sorted({r["ranks"] for r in runs}):
        fractions = sorted({r["fraction"] for r in runs if r["ranks"] == ranks})
        for f in fractions:
            auto = wps(ranks, f, "auto")
            explicit = [wps(ranks, f, fmt) for fmt in FORMATS if fmt != "auto"]
            for e, x in enumerate(auto):
                best = max((w[e] for w in explicit if len(w) > e), default=0.0)
                if best:
                    default_vs_best.append(x / best)
                if ranks == 1 and f in (0.5, 0.33):
                    vs_decode.append(x / results["reference"]["decode_limit"])
        for small, large in zip(fractions, fractions[1:]):
            larger_vs_smaller += [
                b / a for a, b in zip(wps(ranks, small, "auto"), wps(ranks, large, "auto"))
            ]
    for r in runs:
        fills += [f / b for f, b in zip(r["ram_fill_bytes"][1:], r["read_bytes"][1:])]
    hits = results["hits"]
    return [
        (
            "the default >= 0.9x the best explicit ram_format (worst budget)",
            min(default_vs_best, default=0.0),
            0.9,
            True,
        ),
        (
            "a larger budget never slower: windows/s over the next smaller budget's (worst)",
            min(larger_vs_smaller, default=0.0),
            1.0,
            True,
        ),
        (
            "0.5 and 0.33 x decoded, 1 rank: >= 0.7x the single-core decode limit",
            min(vs_decode, default=0.0),
            0.7,
            True,
        ),
        ("RAM fills / bytes read <= 0.10 (worst run)", max(fills, default=0.0), 0.10, False),
        (
            "encoded RAM hit: us over decode + one copy <= 300",
            hits["encoded_ram_over_us"],
            300.0,
            False,
        ),
        ("SSD hit: us over decode + one copy <= 500", hits["ssd_over_us"], 500.0, False),
    ]


def _plot(results: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for ranks in sorted({r["ranks"] for r in results["runs"]}):
        for fmt in FORMATS:
            runs = sorted(
                (r for r in results["runs"] if r["format"] == fmt and r["ranks"] == ranks),
                key=lambda r: r["fraction"],
            )
            if runs:
                ax.plot(
                    [r["fraction"] for r in runs],
                    [float(np.median(r["windows_per_s"][1:] or r["windows_per_s"])) for r in runs],
                    marker="o",
                    label=f"{fmt}, {ranks} rank(s)",
                )
    ax.axhline(results["reference"]["decode_limit"], ls="--", c="grey", label="decode limit")
    ax.axhline(results["reference"]["h5_slab"], ls=":", c="black", label="h5py hyperslab")
    ax.set_xlabel("RAM budget / decoded bytes")
    ax.set_ylabel("windows/s (epochs after the first)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="bench-data/budget")
    p.add_argument("--size", default="500MB", help="decoded size of the corpus")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--per-epoch", type=int, default=150, help="windows per epoch per rank")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    p.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    p.add_argument("--formats", nargs="+", default=list(FORMATS))
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions (medians)")
    p.add_argument("--docs", default="docs")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    work = os.path.abspath(args.work)
    info = prepare(work, args.size)
    warm_ssd(info, work)
    results: dict[str, Any] = {
        **info,
        "epochs": args.epochs,
        "per_epoch": args.per_epoch,
        "runs": [],
    }
    sample = draw(info["store"], 150, seed=7)
    results["reference"] = reference(info, sample)
    results["hits"] = hit_costs(info, work, sample, results["reference"]["decode_limit"])
    print(json.dumps(results["reference"]), json.dumps(results["hits"]), flush=True)
    configs = [
        (ranks, fraction, fmt)
        for ranks in args.ranks
        for fraction in args.fractions
        for fmt in args.formats
        if fraction or fmt == args.formats[0]  # no RAM tier: the format does not matter
    ]
    for ranks in args.ranks:  # not counted: the first run after a freed tier starts slow
        run_config(info, work, args.fractions[0], args.formats[0], 1, args.per_epoch, ranks)
    reps: dict[tuple[int, float, str], list[dict[str, Any]]] = {c: [] for c in configs}
    for rep in range(args.reps):
        for ranks, fraction, fmt in rep_order(configs, rep):
            r = run_config(info, work, fraction, fmt, args.epochs, args.per_epoch, ranks)
            reps[(ranks, fraction, fmt)].append(r)
            print(
                json.dumps(
                    {"rep": rep}
                    | {
                        k: r[k]
                        for k in ("ranks", "fraction", "format", "windows_per_s", "ram_hit_rate")
                    }
                ),
                flush=True,
            )
    results["reps"] = args.reps
    results["repetitions"] = [r for c in configs for r in reps[c]]
    results["runs"] = [median_run(reps[c]) for c in configs]
    if not args.no_write:
        write(results, args.docs)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
