"""A cost model of a RAM tier filled by the reads themselves ("write-through"), #28.

    python tools/model_write_through.py [--ranks 1|4] [--reps 3]   # needs tools/profile_first_epoch.py's store

Not zstore's reader: a small stand-in that reads the first-epoch store
(``bench-data/first-epoch/speech.zarr``: 32 items of 15-45 s, 8 mics) the way the
reader's no-tier path does, window by window (4 random 10 s windows per item, shuffled,
batches of 16 into 4 reused, pre-touched batch buffers): the chunks a window overlaps
are read from the shard files (``preadv``), decoded (python-blosc) and copied into the
batch.  Two modes, in fresh processes, interleaved:

- ``none``: every chunk of every window is decoded;
- ``wt``: each chunk a read decodes is then narrowed to int16 samples and written into
  its shard's sparse tmpfs file (chunk-major: one ``pwrite`` per chunk), with a crc32c,
  and marked present in a one-byte-per-chunk presence file (set after the bytes are
  written, so a writer killed between the two leaves the chunk absent); a chunk marked
  present is widened out of the file's mapping instead of decoded.  No chunk is decoded
  or fetched for the tier alone, and nothing waits: the tier holds what the reads have
  decoded.  With ``--ranks 4`` the ranks are processes reading a quarter of each
  epoch's windows each (``DistributedSampler``'s split), sharing the tmpfs files.

It prints windows/s per epoch (the node's: the slowest rank's time), chunks served from
the tier (hits) and decoded; with one rank, the process's user and system CPU seconds.
Measured results: docs/benchmarks-notes.md, "A RAM tier filled by the reads themselves".
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

import crc32c
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zstore.format.decode import decode_chunk, decode_index  # noqa: E402
from zstore.format.layout import parse_array_meta  # noqa: E402
from zstore.read.streamcopy import copy_values, narrow  # noqa: E402

STORE = Path(__file__).resolve().parents[1] / "bench-data" / "first-epoch" / "speech.zarr"
RATES = {"wav": 16000, "act": 100}
TIER = "/dev/shm/zstore-write-through-model"
WINDOWS = 128  # 32 items x 4 windows, every epoch


def layouts(store: Path) -> dict:
    out = {}
    for it in sorted(d for d in os.listdir(store) if d.startswith("utt")):
        for a in RATES:
            meta = json.loads((store / it / a / "zarr.json").read_text())
            values = "int16" if a == "wav" else None  # as the store's manifest says
            out[it, a] = parse_array_meta(f"{it}/{a}", meta, -1, values)
    return out


def windows(lays: dict, seed: int, per_item: int = 4, seconds: float = 10.0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for it in sorted({it for it, _ in lays}):
        frames = lays[it, "act"].length
        for _ in range(per_item):
            out.append((it, int(rng.integers(0, frames - int(seconds * 100) + 1))))
    rng.shuffle(out)
    return out


class Origin:
    """Chunks read from the local store's shard files (indexes read once)."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.fds: dict[str, int] = {}
        self.indexes: dict[str, np.ndarray] = {}

    def chunk(self, lay, k: int, buf: bytearray) -> memoryview:
        shard, j = divmod(k, lay.chunks_per_shard)
        key = lay.object_key(shard)
        fd = self.fds.get(key)
        if fd is None:
            fd = self.fds[key] = os.open(self.store / key, os.O_RDONLY)
            end = os.fstat(fd).st_size
            raw = os.pread(fd, lay.index_bytes, end - lay.index_bytes)
            self.indexes[key] = decode_index(lay, raw, key)
        off, n = self.indexes[key][j]
        view = memoryview(buf)[:n]
        os.preadv(fd, [view], int(off))
        return view


class Tier:
    """Per shard a sparse, chunk-major tmpfs file of the RAM dtype and a presence file
    of one byte per chunk, both mapped; shared by every process through the files."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.maps: dict[tuple[str, int], tuple] = {}

    def shard(self, lay, shard: int):
        key = (lay.path, shard)
        got = self.maps.get(key)
        if got is None:
            rows = lay.shape[0] if len(lay.shape) == 2 else 1
            n = min(lay.shard, lay.length - shard * lay.shard)
            size = rows * n * lay.ram_dtype.itemsize
            path = f"{self.root}/{lay.path.replace('/', '_')}.{shard}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            hfd = os.open(path + ".have", os.O_RDWR | os.O_CREAT, 0o600)
            if os.fstat(hfd).st_size < lay.chunks_per_shard:
                os.ftruncate(hfd, lay.chunks_per_shard)
            data = np.frombuffer(mmap.mmap(fd, size), dtype=lay.ram_dtype).reshape(-1)
            got = self.maps[key] = (fd, data, rows, mmap.mmap(hfd, lay.chunks_per_shard))
        return got


def read_window(lays, origin, tier, it, s, out, scratch, stats) -> None:
    for a, rate in RATES.items():
        lay = lays[it, a]
        lo = s * (rate // 100)
        hi = lo + 10 * rate
        dst = out[a]
        for k in lay.chunks_for(lo, hi):
            c0, c1 = k * lay.chunk, min((k + 1) * lay.chunk, lay.length)
            a0, a1 = max(lo, c0), min(hi, c1)
            shard, j = divmod(k, lay.chunks_per_shard)
            if tier is not None:
                fd, data, rows, have = tier.shard(lay, shard)
                at = rows * (c0 - shard * lay.shard)  # the chunk's first value in the file
                if have[j]:
                    piece = data[at : at + rows * (c1 - c0)].reshape(rows, c1 - c0)
                    copy_values(dst[..., a0 - lo : a1 - lo], piece[..., a0 - c0 : a1 - c0])
                    stats["hits"] += 1
                    continue
            raw = origin.chunk(lay, k, scratch["raw"])
            chunk = decode_chunk(lay, raw, lay.path, out=scratch[a])
            dst[..., a0 - lo : a1 - lo] = chunk[..., a0 - c0 : a1 - c0]
            stats["decodes"] += 1
            if tier is not None:
                part = chunk[..., : c1 - c0]
                if lay.ram_dtype != lay.dtype:
                    small = np.empty(part.shape, lay.ram_dtype)
                    if not narrow(small, part):
                        continue  # not int16 samples: left to the reads
                    part = small
                part = np.ascontiguousarray(part)
                os.pwrite(fd, part.data, at * part.dtype.itemsize)
                crc32c.crc32c(part.data)  # what the tier would keep to check it by
                have[j] = 1


def rank(rank_: int, ranks: int, mode: str, barrier, results, epochs: int = 4) -> None:
    lays = layouts(STORE)
    tier = Tier(TIER) if mode == "wt" else None
    origin = Origin(STORE)
    scratch = {
        "raw": bytearray(4 << 20),
        "wav": np.empty(lays[next(iter(lays))[0], "wav"].chunk_shape, np.float32),
        "act": np.empty(
            max((lay.chunk_shape for (_, a), lay in lays.items() if a == "act")), np.float32
        ),
    }
    first = lays[next(iter(lays))[0], "wav"].shape[0], lays[next(iter(lays))[0], "act"].shape[0]
    outs = [
        {
            "wav": np.empty((16, first[0], 160000), np.float32),
            "act": np.empty((16, first[1], 1000), np.float32),
        }
        for _ in range(4)
    ]
    for out in outs:  # touched before epoch 0: both modes would pay for it alike
        for buf in out.values():
            buf.fill(0)
    for e in range(epochs):
        mine = windows(lays, e)[rank_::ranks]
        stats = {"hits": 0, "decodes": 0}
        if barrier is not None:
            barrier.wait()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        for b in range(0, len(mine), 16):
            out = outs[(b // 16) % 4]
            for i, (it, s) in enumerate(mine[b : b + 16]):
                read_window(lays, origin, tier, it, s, {a: out[a][i] for a in out}, scratch, stats)
        seconds = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime)
        results.put((e, rank_, seconds, stats["hits"], stats["decodes"], *cpu))
        if barrier is not None:
            barrier.wait()


def once(ranks: int, mode: str, epochs: int = 4) -> list[tuple]:
    shutil.rmtree(TIER, ignore_errors=True)
    os.makedirs(TIER)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(ranks) if ranks > 1 else None
    results = ctx.Queue()
    procs = [
        ctx.Process(target=rank, args=(r, ranks, mode, barrier, results, epochs))
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in range(ranks * epochs)]
    for p in procs:
        p.join()
    shutil.rmtree(TIER, ignore_errors=True)
    out = []
    for e in range(epochs):
        rows = [g for g in got if g[0] == e]
        out.append(
            (
                WINDOWS / max(r[2] for r in rows),
                sum(r[3] for r in rows),
                sum(r[4] for r in rows),
                sum(r[5] for r in rows),
                sum(r[6] for r in rows),
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if not STORE.exists():
        sys.exit(f"{STORE}: run tools/profile_first_epoch.py once first (it makes the store)")
    runs: dict[str, list] = {"none": [], "wt": []}
    for rep in range(args.reps):
        for mode in ("none", "wt") if rep % 2 == 0 else ("wt", "none"):
            res = once(args.ranks, mode)
            runs[mode].append(res)
            print(
                mode.ljust(4),
                " | ".join(f"{w:5.0f} w/s h{h} d{d} u{u:.2f} s{s:.2f}" for w, h, d, u, s in res),
                flush=True,
            )
    for e in range(4):
        none = statistics.median(r[e][0] for r in runs["none"])
        wt = statistics.median(r[e][0] for r in runs["wt"])
        print(f"epoch {e}: none {none:.0f}, write-through {wt:.0f} windows/s ({wt / none:.2f}x)")


if __name__ == "__main__":
    main()
