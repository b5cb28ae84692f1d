"""zstore's tiers as an fsspec caching layer against fsspec's own, 4 processes at once.

    python tools/bench_fsspec.py          # reads ./bench-data/budget/speech.h5 (~480 MB)

Each of 4 processes reads the same 60 random 1 MiB ranges of one file behind the S3-like
latency model (20 ms a request, 100 MB/s a stream), through: zstore.cached_filesystem
(RAM tier 128 MB + SSD tier 256 MB, shared by the processes), fsspec's ``blockcache``
and ``simplecache`` (one shared cache directory each).  Reported: origin bytes, wrong or
short reads (against the file itself), the node's memory (private memory of the
processes + the RAM tier's tmpfs) and the disk the cache used, against the budgets.
Writes the section "fsspec caching layer" of docs/benchmarks.md.
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

import numpy as np

MiB = 2**20
S3 = {"latency": 0.020, "bandwidth": 100e6}
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_docs import private_bytes, replace_section  # noqa: E402

MARK_BEGIN = "<!-- fsspec layer: begin (tools/bench_fsspec.py) -->"
MARK_END = "<!-- fsspec layer: end -->"


def make_fs(kind: str, work: str) -> tuple[Any, Any]:
    import fsspec.implementations.cached as cached

    import zstore
    from zstore.testing import ModelledFileSystem

    origin = ModelledFileSystem(latency=S3["latency"], bandwidth=S3["bandwidth"])
    if kind == "zstore":
        cfg = zstore.CacheConfig(
            ram_dir=f"/dev/shm/zstore-bench-fsspec-{os.getuid()}",
            ram_bytes="128MB",
            ssd_dir=os.path.join(work, "zstore-ssd"),
            ssd_bytes="256MB",
        )
        return zstore.CachedFileSystem(fs=origin, cache=cfg, block_size="1MiB"), origin
    store = os.path.join(work, kind)
    if kind == "blockcache":
        return cached.CachingFileSystem(fs=origin, cache_storage=store, check_files=False), origin
    return cached.SimpleCacheFileSystem(fs=origin, cache_storage=store), origin


def reader(kind: str, path: str, work: str, ranges: list[int], barrier: Any, queue: Any) -> None:
    fs, origin = make_fs(kind, work)
    truth = np.memmap(path, dtype=np.uint8, mode="r")
    barrier.wait()
    t0 = time.perf_counter()
    wrong = 0
    with fs.open(path, "rb") as f:
        for start in ranges:
            f.seek(start)
            data = f.read(MiB)
            if data != truth[start : start + MiB].tobytes():
                wrong += 1
    queue.put(
        {
            "seconds": time.perf_counter() - t0,
            "wrong": wrong,
            "origin_bytes": origin.bytes,
            "private": private_bytes(),
        }
    )
    barrier.wait()  # the node's memory is measured while every process is alive


def run(kind: str, path: str, work: str, ranges: list[int]) -> dict[str, Any]:
    shm = f"/dev/shm/zstore-bench-fsspec-{os.getuid()}"
    for d in (shm, os.path.join(work, "zstore-ssd"), os.path.join(work, kind)):
        shutil.rmtree(d, ignore_errors=True)
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(5), ctx.Queue()
    procs = [
        ctx.Process(target=reader, args=(kind, path, work, ranges, barrier, queue))
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    barrier.wait()
    reports = [queue.get(timeout=3600) for _ in procs]
    from zstore.cache._upkeep import bytes_on_disk

    tmpfs = bytes_on_disk(shm)
    disk = bytes_on_disk(os.path.join(work, "zstore-ssd" if kind == "zstore" else kind))
    barrier.wait()
    for p in procs:
        p.join(600)
    return {
        "kind": kind,
        "origin_bytes": sum(r["origin_bytes"] for r in reports),
        "wrong_reads": sum(r["wrong"] for r in reports),
        "seconds": max(r["seconds"] for r in reports),
        "private": sum(r["private"] for r in reports),
        "tmpfs": tmpfs,
        "disk": disk,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", default="bench-data/budget/speech.h5")
    p.add_argument("--work", default="bench-data/fsspec")
    p.add_argument("--ranges", type=int, default=60)
    p.add_argument("--docs", default="docs")
    args = p.parse_args()
    path, work = os.path.abspath(args.file), os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    size = os.path.getsize(path)
    rng = np.random.default_rng(0)
    ranges = [int(x) for x in rng.integers(0, size - MiB, args.ranges)]
    results = [run(kind, path, work, ranges) for kind in ("zstore", "blockcache", "simplecache")]
    for r in results:
        print(json.dumps(r), flush=True)
    write(results, size, args.ranges, args.docs)


def write(results: list[dict[str, Any]], size: int, n: int, docs: str) -> None:
    with open(os.path.join(docs, "benchmarks-fsspec.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = [
        MARK_BEGIN,
        "",
        "## fsspec caching layer (tools/bench_fsspec.py)",
        "",
        f"4 processes each read the same {n} random 1 MiB ranges of one "
        f"{size / 1e6:.0f} MB file behind the S3-like model. zstore: RAM tier 128 MB + "
        "SSD tier 256 MB shared by the processes; fsspec's layers: one shared cache "
        "directory, no size limit.",
        "",
        "| layer | origin MB | wrong or short reads | seconds | processes' private MB | "
        "RAM tier (tmpfs) MB | cache disk MB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['kind']} | {r['origin_bytes'] / 1e6:.0f} | {r['wrong_reads']} | "
            f"{r['seconds']:.1f} | {r['private'] / 1e6:.0f} | {r['tmpfs'] / 1e6:.0f} | "
            f"{r['disk'] / 1e6:.0f} |"
        )
    lines += ["", MARK_END]
    replace_section(docs, MARK_BEGIN, MARK_END, "\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
