"""Benchmark zstore against the readers users would otherwise pick, on the same data and windows.

    python tools/bench.py                      # ~2 GB of synthetic HDF5 in ./bench-data
    python tools/bench.py --size 300MB --reps 2

Writes docs/benchmarks.md, docs/benchmarks.json and docs/benchmarks.png.  Every
contender reads the same random (item, start) list of 10 s windows, interleaved,
``--reps`` times; tables report medians and ratios in the same run.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_contenders import (  # noqa: E402
    HOP,
    Contender,
    Paths,
    rank_worker,
    run_windows,
    window_spans,
    zstore_cache,
)
from bench_docs import in_turn  # noqa: E402
from bench_report import write_report  # noqa: E402

WINDOW_FRAMES = 1000  # 10 s at 100 frames/s
NFS = {"latency": 0.001, "bandwidth": 1e9}
S3 = {"latency": 0.020, "bandwidth": 100e6}


def prepare(work: str, size: str) -> tuple[Paths, dict[str, Any]]:
    """Generate (or reuse) the HDF5 file, the zstore store and the Arrow copy."""
    import zstore
    from zstore.testing.synthetic import SyntheticSpec, items_for_size, make_synthetic
    from zstore.units import parse_size
    from zstore.urls import store_bytes

    work = os.path.abspath(work)
    os.makedirs(work, exist_ok=True)
    paths = Paths(
        h5=os.path.join(work, "speech.h5"),
        store=os.path.join(work, "speech.zarr"),
        arrow=os.path.join(work, "speech.arrow"),
        work=work,
    )
    meta_path = os.path.join(work, "prepared.json")
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
    if meta.get("size") != size:
        spec = SyntheticSpec(items=1)
        spec = SyntheticSpec(items=items_for_size(parse_size(size), spec))
        print(f"generating {spec.items} items (~{size}) ...", flush=True)
        make_synthetic(paths.h5, spec, progress=True)
        report = zstore.convert(
            paths.h5,
            paths.store,
            rates={"wav": 16000, "act": 100},
            overwrite=True,
            workers=os.cpu_count(),
        )
        shutil.rmtree(paths.arrow, ignore_errors=True)
        t0 = time.perf_counter()
        arrow_from_h5(paths.h5, paths.arrow)
        meta = {
            "size": size,
            "items": spec.items,
            "convert_seconds": report.seconds,
            "source_bytes": report.source_bytes,
            "store_bytes": report.store_bytes,
            "arrow_seconds": time.perf_counter() - t0,
        }
        json.dump(meta, open(meta_path, "w"))
    meta["h5_bytes"] = os.path.getsize(paths.h5)
    meta["arrow_bytes"] = store_bytes(paths.arrow)
    meta["store_bytes"] = store_bytes(paths.store)
    return paths, meta


def arrow_from_h5(h5: str, out: str) -> None:
    """The Arrow copy users were advised to make: one row per item, uncompressed."""
    import datasets
    import h5py

    with h5py.File(h5, "r") as f:
        names = sorted(f)
        mics, spk = f[names[0]]["wav"].shape[0], f[names[0]]["act"].shape[0]

    def rows():
        with h5py.File(h5, "r") as f:
            for name in names:
                yield {"name": name, "wav": f[name]["wav"][()].T, "act": f[name]["act"][()].T}

    features = datasets.Features(
        {
            "name": datasets.Value("string"),
            "wav": datasets.Array2D(shape=(None, mics), dtype="float32"),
            "act": datasets.Array2D(shape=(None, spk), dtype="float32"),
        }
    )
    ds = datasets.Dataset.from_generator(
        rows, features=features, cache_dir=os.path.join(os.path.dirname(out), "hf-cache")
    )
    ds.save_to_disk(out)
    shutil.rmtree(os.path.join(os.path.dirname(out), "hf-cache"), ignore_errors=True)


def draw_windows(store: str, n: int, seed: int = 0) -> list[tuple[int, str, int]]:
    from zstore.read import WindowReader

    m = WindowReader(store).open().manifest
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        i = int(rng.integers(len(m.items)))
        start = int(rng.integers(0, m.lengths["act"][i] - WINDOW_FRAMES + 1))
        out.append((i, m.items[i], start))
    return out


def contenders(work: str) -> list[tuple[Contender, float, int]]:
    """(contender, seconds budget per rep, max windows per rep)."""
    ram = "/dev/shm/zstore-bench" if os.path.isdir("/dev/shm") else os.path.join(work, "ram")
    decoded = {"ram_dir": ram + "-dec", "ram_bytes": "8GB", "ram_format": "decoded"}
    encoded = {"ram_dir": ram + "-enc", "ram_bytes": "8GB", "ram_format": "encoded"}
    ssd = {"ssd_dir": os.path.join(work, "ssd-cache"), "ssd_bytes": "8GB"}
    warm, cold, slow = (8.0, 400), (8.0, 100), (12.0, 40)
    return [
        (Contender("h5py whole group + crop", "h5-whole"), *warm),
        (Contender("h5py hyperslab", "h5-slab"), *warm),
        (Contender("HF datasets (Arrow) + crop", "hf"), *warm),
        (Contender("zarr-python indexing", "zarr"), *warm),
        (Contender("zstore RAM hits (decoded)", "zstore", {"cache": decoded}), *warm),
        (Contender("zstore RAM hits (encoded)", "zstore", {"cache": encoded}), *warm),
        (Contender("zstore SSD hits", "zstore", {"cache": ssd}), *warm),
        (Contender("zstore cold, local origin", "zstore", {}), *cold),
        (Contender("h5py whole, NFS-like", "h5-whole", dict(NFS)), *cold),
        (Contender("h5py hyperslab, NFS-like", "h5-slab", dict(NFS)), *cold),
        (Contender("zstore cold, NFS-like", "zstore", dict(NFS)), *cold),
        (Contender("h5py whole, S3-like", "h5-whole", dict(S3)), *slow),
        (Contender("h5py hyperslab, S3-like", "h5-slab", dict(S3)), *slow),
        (Contender("zstore cold, S3-like", "zstore", dict(S3)), *slow),
    ]


def clear_tiers(options: dict[str, Any]) -> None:
    for key in ("ram_dir", "ssd_dir"):
        if options.get("cache", {}).get(key):
            shutil.rmtree(options["cache"][key], ignore_errors=True)


def single_process(paths: Paths, windows: list, reps: int) -> dict[str, list[float]]:
    runs = contenders(paths.work)
    for c, _, n in runs:  # warm the cached contenders on the windows they will read:
        if c.options.get("cache"):  # the first pass fills the tiers, the second maps them
            clear_tiers(c.options)
            for _ in range(2):
                run_windows(c, paths, windows[:n], WINDOW_FRAMES, 1e9)
                c.settle()
    results: dict[str, list[float]] = {c.name: [] for c, _, _ in runs}
    # interleaved, each contender first in turn: none always runs right after another
    # one's pass (tools/profile_first_epoch.py found this machine's first run after a
    # change slower, whichever configuration it was)
    for c, budget, n in in_turn(runs, reps):
        count, seconds = run_windows(c, paths, windows[:n], WINDOW_FRAMES, budget)
        results[c.name].append(count / seconds)
        rep = len(results[c.name]) - 1
        print(f"rep {rep}: {c.name:32s} {count / seconds:9.1f} windows/s", flush=True)
    return results


class WindowSet:
    """A torch Dataset over a fixed window list, for the DataLoader scenario."""

    def __init__(self, contender: Contender, paths: Paths, windows: list):
        self.contender, self.paths, self.windows = contender, paths, windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> Any:
        index, item, start = self.windows[i]
        return self.contender.read(self.paths, index, item, start, WINDOW_FRAMES)


def dataloader(paths: Paths, windows: list, reps: int, workers: int = 2) -> dict[str, list]:
    import torch

    chosen = [
        c
        for c, _, _ in contenders(paths.work)
        if c.name
        in (
            "h5py whole group + crop",
            "h5py hyperslab",
            "HF datasets (Arrow) + crop",
            "zstore RAM hits (decoded)",
        )
    ]
    results: dict[str, list[float]] = {c.name: [] for c in chosen}
    for c in in_turn(chosen, reps):  # interleaved, each first in turn
        dataset: Any = WindowSet(c, paths, windows[:400])  # a map-style dataset
        loader: Any = torch.utils.data.DataLoader(dataset, batch_size=8, num_workers=workers)
        t0, n = time.perf_counter(), 0
        for batch in loader:
            n += len(batch[0])
        results[c.name].append(n / (time.perf_counter() - t0))
        print(
            f"rep {len(results[c.name]) - 1}: DataLoader x{workers} {c.name:28s} "
            f"{results[c.name][-1]:9.1f}",
            flush=True,
        )
    return results


def shared_ranks(paths: Paths, windows: list, ranks: int = 4) -> dict[str, Any]:
    """4 processes as ranks on one fresh node cache over an NFS-like origin."""
    import zstore

    ram = "/dev/shm/zstore-bench-ranks"
    cache = {
        "ram_dir": ram,
        "ram_bytes": "1GB",
        "ssd_dir": os.path.join(paths.work, "ssd-ranks"),
        "ssd_bytes": "4GB",
        "fetch": "range",
    }
    options = {"cache": cache, **NFS}
    out: dict[str, Any] = {"ram_budget": 10**9}
    for label, n in (("alone", 1), ("shared", ranks)):
        clear_tiers(options)
        ctx = mp.get_context("spawn")
        barrier, queue, release = ctx.Barrier(n), ctx.Queue(), ctx.Event()
        procs = [
            ctx.Process(
                target=rank_worker,
                args=(
                    paths,
                    options,
                    windows[r * len(windows) // n :] + windows[: r * len(windows) // n],
                    WINDOW_FRAMES,
                    barrier,
                    queue,
                    release,
                ),
            )
            for r in range(n)
        ]
        tmpfs_before = shutil.disk_usage("/dev/shm").used
        for p in procs:
            p.start()
        reports = [queue.get(timeout=1800) for _ in procs]
        # tmpfs in use, evicted files still mapped by a rank included, while ranks hold on
        tmpfs_used = shutil.disk_usage("/dev/shm").used - tmpfs_before
        stats = zstore.cache_stats(zstore_cache(paths, options))
        release.set()
        for p in procs:
            p.join(timeout=600)
        out[label] = {"ranks": reports, "stats": stats, "tmpfs_used": tmpfs_used}
    clear_tiers(options)
    return out


def overhead(paths: Paths, windows: list) -> dict[str, float]:
    """Per-window RAM-hit time minus the one copy out of the mapped shards.

    Rounds alternate a pass of full reads over the sample with a pass of the copies alone
    (the same ``assemble`` calls on the same mapped tmpfs pages, lookups done
    beforehand); the median over rounds of (read pass - copy pass) / windows is what the
    read path adds.  Whole passes, not window pairs: a copy right after the read of the
    same window would find its source in the CPU cache and look cheaper than it is.
    """
    from zstore.read._window_copy import assemble

    c = [c for c, _, _ in contenders(paths.work) if c.name == "zstore RAM hits (decoded)"][0]
    sample = windows[:200]
    for _ in range(2):  # fill the tier, then map it
        run_windows(c, paths, sample, WINDOW_FRAMES, 1e9)
        c.settle()
    reader = c._state
    work = []
    for _, item, start in sample:
        spans = window_spans(start, WINDOW_FRAMES)
        plan = [(k, reader.layout(item, k), v) for k, v in spans.items()]
        work.append((item, spans, plan, reader._pieces(plan)))
    totals, copies = [], []
    for _ in range(7):
        t0 = time.perf_counter()
        for item, spans, _, _ in work:
            reader.read(item, spans)
        t1 = time.perf_counter()
        for _, _, plan, pieces in work:
            for _, layout, span in plan:
                assemble(layout, span, pieces)
        t2 = time.perf_counter()
        totals.append((t1 - t0) / len(work))
        copies.append((t2 - t1) / len(work))
    diffs = [t - c for t, c in zip(totals, copies)]
    return {
        "window_us": statistics.median(totals) * 1e6,
        "copy_us": statistics.median(copies) * 1e6,
        "overhead_us": statistics.median(diffs) * 1e6,
    }


def origin_bytes(paths: Paths, windows: list) -> dict[str, float]:
    """Bytes a cold window reads from the origin (range fetch) vs its compressed size."""
    from zstore.read import WindowReader
    from zstore.testing import ModelledFileSystem

    fs = ModelledFileSystem()
    reader = WindowReader(paths.store, origin_fs=fs).open()
    compressed, n = 0.0, 0
    for _index, item, start in windows[:100]:
        for name, hop in (("wav", HOP), ("act", 1)):
            layout = reader.layout(item, name)
            obj = sum(
                os.path.getsize(os.path.join(paths.store, layout.object_key(s)))
                for s in range(-(-layout.length // layout.shard))
            )
            compressed += obj * (WINDOW_FRAMES * hop) / layout.length
        reader.read(item, window_spans(start, WINDOW_FRAMES))
        n += 1
    return {
        "origin_bytes_per_window": fs.bytes / n,
        "compressed_bytes_per_window": compressed / n,
        "requests_per_window": fs.requests / n,
    }


def fetch_modes(paths: Paths, windows: list) -> dict[str, Any]:
    """range vs shard on an S3-like origin, over windows of a few items (shards reused)."""
    import zstore

    few = [w for w in windows if w[0] < 6][:48]
    out = {}
    for mode in ("range", "shard"):
        cache = {
            "ram_dir": None,
            "ssd_dir": os.path.join(paths.work, f"ssd-{mode}"),
            "ssd_bytes": "8GB",
            "fetch": mode,
        }
        c = Contender(mode, "zstore", {"cache": cache, **S3})
        clear_tiers(c.options)
        n, seconds = run_windows(c, paths, few, WINDOW_FRAMES, 1e9)
        stats = zstore.cache_stats(zstore_cache(paths, c.options))
        out[mode] = {
            "windows": n,
            "seconds": seconds,
            "requests": stats["origin"]["requests"],
            "bytes": stats["origin"]["bytes"],
        }
        clear_tiers(c.options)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", default="2GB", help="synthetic HDF5 size (2GB)")
    p.add_argument("--work", default="bench-data", help="data directory (./bench-data)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="docs", help="where benchmarks.md/.json/.png go")
    args = p.parse_args()
    t0 = time.time()
    paths, meta = prepare(args.work, args.size)
    windows = draw_windows(paths.store, 400)
    results: dict[str, Any] = {
        "meta": meta,
        "command": " ".join(["python", "tools/bench.py"] + sys.argv[1:]),
        "single": single_process(paths, windows, args.reps),
        "dataloader": dataloader(paths, windows, max(1, args.reps - 1)),
        "ranks": shared_ranks(paths, windows[:200]),
        "overhead": overhead(paths, windows),
        "origin": origin_bytes(paths, windows),
        "fetch_modes": fetch_modes(paths, windows),
    }
    for c, _, _ in contenders(paths.work):
        clear_tiers(c.options)
    results["seconds"] = time.time() - t0
    write_report(results, args.out)
    print(f"wrote {args.out}/benchmarks.md in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
