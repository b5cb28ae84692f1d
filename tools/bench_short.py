"""Corpora of short utterances: zstore's packed layout side by side with h5py and LitData.

    python tools/bench_short.py                      # 10k and 100k items
    python tools/bench_short.py --sizes 10000 --reps 3

Each corpus is one HDF5 file of N utterances of 0.1-1.0 s under 100 speaker groups
(``wav`` 1 x samples float32 holding int16 values at 16 kHz, ``act`` 2 x frames at
100/s), made by ``zstore.testing.synthetic``.  Per N, in one run:

- writing: zstore convert (2 workers, a fresh process: pool start-up included) and
  LitData ``optimize`` (2 workers, zstd, 64 MB chunks), both fed from the HDF5 file;
- objects per item (files and directories) and bytes on disk against the HDF5 file;
  zstore also on S3 (moto, objects and bytes);
- reads, random order, interleaved repetitions: whole items through ``ds[i]`` (warm
  RAM tier), h5py reading each item's datasets, LitData's ``StreamingDataset[i]``;
  1 s windows through ``ds[i]`` and h5py hyperslabs; batches of 32 windows of 1 s
  through ``WindowLoader`` against a DataLoader with 2 workers over the same dataset.

- MosaicML streaming: ``MDSWriter`` (one process, zstd, 64 MB shards) and its
  ``StreamingDataset[i]``.

Peers are installed beside the project's environment, not into it (their dependencies
would replace its torch)::

    pip install --no-deps --target /tmp/peers/lib litdata==0.2.76 mosaicml-streaming==0.13.0 \
        obstore zstd xxhash python-snappy cramjam brotli catalogue transformers==4.57.6 \
        huggingface_hub==0.36.2 tokenizers==0.22.2 safetensors regex
    PYTHONPATH=/tmp/peers/lib python tools/bench_short.py

mosaicml-streaming 0.13 imports its vision datasets, and with them torchvision, when it
is imported; the package index here has only CUDA builds of torchvision, which do not
load beside the CPU build of torch (``operator torchvision::nms does not exist``). So
the tool puts a stand-in for the two torchvision names those modules import on the
path (:func:`torchvision_standin`); MDS's writer and reader never use them.

Writes the section "Short utterances" of docs/benchmarks.md, docs/benchmarks-short.json
and docs/benchmarks-short.png.
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
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_docs import replace_section  # noqa: E402

MARK_BEGIN = "<!-- short: begin (tools/bench_short.py) -->"
MARK_END = "<!-- short: end -->"
RATES = {"wav": 16000, "act": 100}
#: corpora up to this many items are converted `--reps` times by every writer
CONVERT_REPS_UPTO = 10_000
#: windows each loader run reads (an epoch of 100k items would take minutes per run)
LOADER_WINDOWS = 10_000


def make_h5(path: Path, n: int) -> None:
    from zstore.testing import SyntheticSpec, make_synthetic

    if path.exists():
        return
    spec = SyntheticSpec(
        items=n, mics=1, speakers=2, min_seconds=0.1, max_seconds=1.0, groups=100, seed=n
    )
    make_synthetic(path, spec, progress=True)


def disk(path: Path) -> tuple[int, int]:
    """(bytes of disk blocks, files + directories) under ``path`` (itself counted)."""
    if path.is_file():
        return path.stat().st_blocks * 512, 1
    blocks, count = path.stat().st_blocks * 512, 1
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            st = os.lstat(os.path.join(root, name))
            blocks += st.st_blocks * 512
            count += 1
    return blocks, count


CONVERT = """
import sys, time, zstore
t = time.perf_counter()
zstore.convert(sys.argv[1], sys.argv[2], rates={"wav": 16000, "act": 100}, workers=2,
               progress=False, codec=sys.argv[3])
print(time.perf_counter() - t)
"""


def zstore_convert(src: Path, dst: Path, codec: str) -> float:
    """Seconds of ``zstore.convert`` in a fresh process (its worker pool's start-up and
    the scan of the source included; the interpreter's imports not)."""
    took = _timed("zstore", [sys.executable, "-c", CONVERT, str(src), str(dst), codec], dst)
    if took is None:
        raise RuntimeError("zstore convert failed (its output is above)")
    return took


def _timed(name: str, cmd: list[str], dst: Path) -> float | None:
    """Run a writer's script into a fresh ``dst``: the seconds it prints last, or None
    (with its error) when it fails."""
    shutil.rmtree(dst, ignore_errors=True)
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        print(f"{name} failed:", (getattr(e, "stderr", "") or "")[-2000:], file=sys.stderr)
        return None
    return float(out.stdout.strip().splitlines()[-1])


LITDATA = """
import sys, time, h5py
from litdata import optimize

src, dst = sys.argv[1], sys.argv[2]

def names():
    out = []
    with h5py.File(src, "r") as f:
        f.visititems(lambda n, o: out.append(n) if isinstance(o, h5py.Group) and "wav" in o else None)
    return out

def item(name):
    with h5py.File(src, "r") as f:
        g = f[name]
        return {"name": name, "wav": g["wav"][()], "act": g["act"][()]}

if __name__ == "__main__":
    t = time.perf_counter()
    optimize(fn=item, inputs=names(), output_dir=dst, chunk_bytes="64MB", num_workers=2,
             compression="zstd", mode="overwrite")
    print(time.perf_counter() - t)
"""


def litdata_convert(src: Path, dst: Path, work: Path) -> float | None:
    script = work / "litdata_write.py"  # optimize() spawns workers: a file, not -c
    script.write_text(LITDATA)
    return _timed("litdata", [sys.executable, str(script), str(src), str(dst)], dst)


STANDIN = {
    "__init__.py": '"""A stand-in for torchvision (tools/bench_short.py)."""\n',
    "datasets/__init__.py": (
        "import torch.utils.data\n\n\n"
        "class VisionDataset(torch.utils.data.Dataset):\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        raise RuntimeError('stand-in: torchvision is not installed')\n\n\n"
        "CIFAR10 = VisionDataset\n"
    ),
    "transforms/__init__.py": "",
    "transforms/functional.py": (
        "def to_tensor(*args, **kwargs):\n"
        "    raise RuntimeError('stand-in: torchvision is not installed')\n"
    ),
}


def torchvision_standin(work: Path) -> None:
    """Make ``import streaming`` work without torchvision (see the module docstring)."""
    try:
        import torchvision  # noqa: F401

        return
    except Exception:
        sys.modules.pop("torchvision", None)
    root = work / "standin"
    for rel, text in STANDIN.items():
        path = root / "torchvision" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")


MDS = """
import sys, time, h5py
from streaming import MDSWriter

src, dst = sys.argv[1], sys.argv[2]
t = time.perf_counter()
columns = {"name": "str", "wav": "ndarray:float32", "act": "ndarray:float32"}
with h5py.File(src, "r") as f, MDSWriter(out=dst, columns=columns, compression="zstd",
                                          size_limit="64mb") as out:
    names = []
    f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Group) and "wav" in o else None)
    for name in names:
        g = f[name]
        out.write({"name": name, "wav": g["wav"][()], "act": g["act"][()]})
print(time.perf_counter() - t)
"""


def mds_convert(src: Path, dst: Path) -> float | None:
    return _timed("mds", [sys.executable, "-c", MDS, str(src), str(dst)], dst)


def s3_objects(store_src: Path, n: int) -> tuple[int, int]:
    """(objects, bytes) of the store converted to a moto S3 server."""
    from moto.server import ThreadedMotoServer

    import zstore

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = {
            "key": "k",
            "secret": "s",
            "client_kwargs": {"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"},
        }
        import boto3
        import s3fs

        client = boto3.client(
            "s3",
            endpoint_url=f"http://{host}:{port}",
            region_name="us-east-1",
            aws_access_key_id="k",
            aws_secret_access_key="s",
        )
        if "bench" not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
            client.create_bucket(Bucket="bench")  # moto keeps buckets across servers
        fs = s3fs.S3FileSystem(**options)
        zstore.convert(
            str(store_src),
            f"s3://bench/s{n}.zarr",
            rates=RATES,
            workers=2,
            progress=False,
            storage_options=options,
        )
        found = fs.find(f"bench/s{n}.zarr", detail=True)
        return len(found), sum(int(v["size"]) for v in found.values())
    finally:
        server.stop()


def reads(
    h5: Path, store: Path, lit: Path | None, mds: Path | None, work: Path, n: int, reps: int
) -> dict:
    """Random reads per second, medians of interleaved repetitions."""
    import h5py
    import torch

    import zstore

    ram = tempfile.mkdtemp(prefix="bench-short-", dir="/dev/shm")  # the RAM tier: tmpfs
    cache = zstore.CacheConfig(ram_dir=ram, ram_bytes="6GB", ssd_dir=None)
    whole = zstore.WindowDataset(str(store), window_seconds=None, cache=cache)
    window = zstore.WindowDataset(str(store), window_seconds=1.0, cache=cache, seed=1)
    names = list(whole.reader.open().manifest.items)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(whole))[: min(len(whole), 5000)]
    f = h5py.File(h5, "r")
    lit_ds = None
    if lit is not None:
        from litdata import StreamingDataset

        lit_ds = StreamingDataset(str(lit))
    mds_ds = None
    if mds is not None:
        from streaming import StreamingDataset as MDSDataset

        mds_ds = MDSDataset(local=str(mds), shuffle=False, batch_size=1)
        for i in range(len(mds_ds)):  # one pass, as zstore's tier is warmed
            mds_ds[i]
    for i in range(len(whole)):  # warm the RAM tier: one pass
        whole[i]
    whole.settle(timeout=600)  # the shards it filled behind its reads are in
    draws = [window.window((0, int(i))) for i in order]

    def zs_whole() -> int:
        for i in order:
            whole[int(i)]
        return len(order)

    def h5_whole() -> int:
        for i in order:
            g = f[names[i]]
            g["wav"][()]
            g["act"][()]
        return len(order)

    def zs_window() -> int:
        for i in order:
            window[(0, int(i))]
        return len(order)

    def h5_window() -> int:
        for w in draws:  # the same windows, padded with zeros as zstore pads them
            g = f[names[w.item]]
            act = np.zeros((g["act"].shape[0], w.take + w.pad), dtype=np.float32)
            act[:, : w.take] = g["act"][:, w.start : w.start + w.take]
            wav = np.zeros((g["wav"].shape[0], (w.take + w.pad) * 160), dtype=np.float32)
            part = g["wav"][:, w.start * 160 : (w.start + w.take) * 160]
            wav[:, : part.shape[1]] = part
        return len(draws)

    def lit_whole() -> int:
        k = min(len(order), 200)  # it decompresses a whole chunk per item
        for i in order[:k]:
            lit_ds[int(i)]  # type: ignore[index]
        return k

    def mds_whole() -> int:
        for i in order:
            mds_ds[int(i)]  # type: ignore[index]
        return len(order)

    def first(loader: Any, most: int = LOADER_WINDOWS) -> int:
        count = 0
        for batch in loader:
            count += len(batch["item"])
            if count >= most:
                break
        return count

    def zs_loader() -> int:
        return first(zstore.WindowLoader(window, batch_size=32, shuffle=True))

    def dl_loader() -> int:  # its workers' start-up included, as a training epoch has it
        plain = zstore.WindowDataset(str(store), window_seconds=1.0, cache=cache, seed=1)
        return first(torch.utils.data.DataLoader(plain, batch_size=32, shuffle=True, num_workers=2))

    runs = {
        "zstore whole": zs_whole,
        "h5py whole": h5_whole,
        "zstore 1 s window": zs_window,
        "h5py 1 s window": h5_window,
        "WindowLoader": zs_loader,
        "DataLoader(2)": dl_loader,
    }
    if lit_ds is not None:
        runs["LitData whole"] = lit_whole
    if mds_ds is not None:
        runs["MDS whole"] = mds_whole
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            t = time.perf_counter()
            count = fn()
            rates[name].append(count / (time.perf_counter() - t))
    shutil.rmtree(ram, ignore_errors=True)
    return {k: statistics.median(v) for k, v in rates.items()} | {
        k + " spread": [min(v), max(v)] for k, v in rates.items()
    }


def cached(path: Path) -> None:
    """Read ``path`` once, so every writer starts from the page cache: the first one
    timed otherwise read the file from disk (100,000 items: 50 s against 19 s) while
    the others found it cached."""
    with open(path, "rb", buffering=0) as f:
        while f.read(64 * 2**20):
            pass


def run_size(n: int, data: Path, reps: int, s3: bool) -> dict:
    h5 = data / f"short{n}.h5"
    make_h5(h5, n)
    work = Path(tempfile.mkdtemp(prefix=f"short{n}-", dir=data))
    try:
        store, lit, mds = work / "s.zarr", work / "lit", work / "mds"
        out: dict[str, Any] = {"items": n}
        torchvision_standin(data)
        cached(h5)
        # The writers in turn, `reps` times up to CONVERT_REPS_UPTO items (this machine's
        # speed varies from minute to minute): the median of each, and the spread.
        times: dict[str, list[float]] = {"zstore": [], "litdata": [], "mds": []}
        for _ in range(reps if n <= CONVERT_REPS_UPTO else 1):
            times["zstore"].append(zstore_convert(h5, store, "zstd"))
            for name, run in (("litdata", lambda: litdata_convert(h5, lit, work)),
                              ("mds", lambda: mds_convert(h5, mds))):  # fmt: skip
                spent = run()
                if spent is not None:
                    times[name].append(spent)
        for name, took in times.items():
            out[f"{name} convert s"] = statistics.median(took) if took else None
            out[f"{name} convert spread"] = [n / max(took), n / min(took)] if took else None
        seconds, mds_seconds = out["litdata convert s"], out["mds convert s"]
        h5_bytes, _ = disk(h5)
        out["h5 bytes"] = h5_bytes
        for name, path in (
            ("zstore", store),
            ("litdata", lit if seconds else None),
            ("mds", mds if mds_seconds else None),
        ):
            if path is None:
                continue
            nbytes, count = disk(path)
            out[f"{name} bytes"] = nbytes
            out[f"{name} objects per item"] = count / n
        if s3:
            objects, nbytes = s3_objects(h5, n)
            out["zstore s3 objects per item"] = objects / n
            out["zstore s3 bytes"] = nbytes
        out["reads"] = reads(
            h5, store, lit if seconds else None, mds if mds_seconds else None, work, n, reps
        )
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ns = [r["items"] for r in results]
    ax = axes[0]
    ax.plot(ns, [r["items"] / r["zstore convert s"] for r in results], "o-", label="zstore")
    if all(r.get("litdata convert s") for r in results):
        ax.plot(ns, [r["items"] / r["litdata convert s"] for r in results], "s-", label="LitData")
    if all(r.get("mds convert s") for r in results):
        ax.plot(ns, [r["items"] / r["mds convert s"] for r in results], "d-", label="MDS")
    ax.set(xscale="log", xlabel="items", ylabel="items/s written", title="Conversion")
    ax.legend()
    ax = axes[1]
    ax.plot(ns, [r["zstore bytes"] / r["h5 bytes"] for r in results], "o-", label="zstore")
    if all("litdata bytes" in r for r in results):
        ax.plot(ns, [r["litdata bytes"] / r["h5 bytes"] for r in results], "s-", label="LitData")
    if all("mds bytes" in r for r in results):
        ax.plot(ns, [r["mds bytes"] / r["h5 bytes"] for r in results], "d-", label="MDS")
    ax.set(xscale="log", xlabel="items", ylabel="bytes on disk / HDF5", title="Disk")
    ax.legend()
    ax = axes[2]
    for key, style in (
        ("zstore whole", "o-"),
        ("h5py whole", "^-"),
        ("LitData whole", "s-"),
        ("MDS whole", "d-"),
        ("WindowLoader", "o--"),
        ("DataLoader(2)", "^--"),
    ):
        if all(key in r["reads"] for r in results):
            ax.plot(ns, [r["reads"][key] for r in results], style, label=key)
    ax.set(xscale="log", yscale="log", xlabel="items", ylabel="items/s", title="Random reads")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: list[dict]) -> list[str]:
    lines = [
        "| items | | write items/s | bytes on disk vs HDF5 | objects per item | "
        "whole items/s (random) | vs h5py |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        n, rd = r["items"], r["reads"]
        h5w = rd["h5py whole"]
        lines.append(
            f"| {n:,} | zstore (packed, zstd) | {n / r['zstore convert s']:,.0f} | "
            f"{r['zstore bytes'] / r['h5 bytes']:.2f}x | {r['zstore objects per item']:.3f} | "
            f"{rd['zstore whole']:,.0f} | {rd['zstore whole'] / h5w:.1f}x |"
        )
        if r.get("mds convert s"):
            lines.append(
                f"| | MosaicML streaming (MDSWriter, one process, zstd) | "
                f"{n / r['mds convert s']:,.0f} | {r['mds bytes'] / r['h5 bytes']:.2f}x | "
                f"{r['mds objects per item']:.3f} | {rd.get('MDS whole', 0):,.0f} | "
                f"{rd.get('MDS whole', 0) / h5w:.2f}x |"
            )
        if r.get("litdata convert s"):
            lines.append(
                f"| | LitData (optimize, 2 workers, zstd) | {n / r['litdata convert s']:,.0f} | "
                f"{r['litdata bytes'] / r['h5 bytes']:.2f}x | "
                f"{r['litdata objects per item']:.3f} | {rd.get('LitData whole', 0):,.0f} | "
                f"{rd.get('LitData whole', 0) / h5w:.2f}x |"
            )
        lines.append(f"| | h5py (the HDF5 file) | - | 1.00x | - | {h5w:,.0f} | 1.0x |")
    lines += [
        "",
        "| items | 1 s windows, ds[i] | h5py hyperslabs | ratio | WindowLoader (32) | "
        "DataLoader(2 workers) | ratio | zstore on S3: objects per item, bytes vs HDF5 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rd = r["reads"]
        s3 = (
            f"{r['zstore s3 objects per item']:.3f}, {r['zstore s3 bytes'] / r['h5 bytes']:.2f}x"
            if "zstore s3 objects per item" in r
            else "-"
        )
        lines.append(
            f"| {r['items']:,} | {rd['zstore 1 s window']:,.0f} | {rd['h5py 1 s window']:,.0f} | "
            f"{rd['zstore 1 s window'] / rd['h5py 1 s window']:.1f}x | {rd['WindowLoader']:,.0f} | "
            f"{rd['DataLoader(2)']:,.0f} | {rd['WindowLoader'] / rd['DataLoader(2)']:.1f}x | {s3} |"
        )
    return lines


def write(results: list[dict], docs: str) -> None:
    writes = "; ".join(
        f"{r['items']:,}: "
        + ", ".join(
            f"{name} {r[key][0]:,.0f}-{r[key][1]:,.0f}"
            for name, key in (
                ("zstore", "zstore convert spread"),
                ("MDS", "mds convert spread"),
                ("LitData", "litdata convert spread"),
            )
            if r.get(key) and r[key][0] != r[key][1]
        )
        for r in results  # sizes written once have no spread
        if r.get("zstore convert spread")
        and r["zstore convert spread"][0] != r["zstore convert spread"][1]
    )
    spreads = "; ".join(
        f"{r['items']:,}: "
        + ", ".join(
            f"{k[: -len(' spread')]} {v[0]:,.0f}-{v[1]:,.0f}"
            for k, v in r["reads"].items()
            if k.endswith(" spread")
        )
        for r in results
    )
    section = "\n".join(
        [
            MARK_BEGIN,
            "## Short utterances (tools/bench_short.py)",
            "",
            "Corpora of N utterances of 0.1-1.0 s (mono 16 kHz float32 holding int16 values, "
            "`act` at 100/s, 100 speaker groups), one HDF5 file each; every writer fed from "
            "it, the file in the page cache first; one run, reads as medians of interleaved "
            "repetitions from a warm page cache (zstore: warm RAM tier). zstore packs items of at most 10 s (the default "
            "`pack_seconds`). MosaicML streaming runs with a stand-in for torchvision, "
            "which it imports but does not use here (see the tool's docstring).",
            "",
            *table(results),
            "",
            f"Spreads (items/s): {spreads}. Writing, medians of the runs in turn (items/s): "
            f"{writes}.",
            "",
            "![short utterances](benchmarks-short.png)",
            MARK_END,
        ]
    )
    replace_section(docs, MARK_BEGIN, MARK_END, section)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "zstore-short"))
    p.add_argument("--no-s3", action="store_true")
    p.add_argument(
        "--reuse", action="store_true", help="take a size's results from an earlier run's file"
    )
    p.add_argument("--docs", default=os.path.join(os.path.dirname(__file__), "..", "docs"))
    args = p.parse_args()
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    results = []
    for n in args.sizes:
        saved = data / f"results-{n}.json"  # each size's run, kept as soon as it is done
        if args.reuse and saved.exists():
            r = json.loads(saved.read_text())
        else:
            r = run_size(n, data, args.reps, not args.no_s3)
            saved.write_text(json.dumps(r, indent=1))
        print(json.dumps(r, indent=1))
        results.append(r)
    with open(os.path.join(args.docs, "benchmarks-short.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(args.docs, "benchmarks-short.png"))
    write(results, args.docs)


if __name__ == "__main__":
    main()
