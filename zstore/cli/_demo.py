"""``zstore demo``: generate a small HDF5 file, convert it, read windows through the cache
and, the same windows, through h5py."""

from __future__ import annotations

import os
import resource
import shutil
import time

import h5py
import numpy as np

from zstore.cache import CacheConfig, cache_stats, clear_cache
from zstore.convert import convert
from zstore.testing import ACT_RATE, WAV_RATE, SyntheticSpec, make_synthetic
from zstore.train import WindowDataset, WindowLoader
from zstore.units import format_size


def run_demo(
    workdir: str = "zstore-demo",
    *,
    items: int = 16,
    epochs: int = 3,
    windows_per_item: int = 8,
    batch_size: int = 16,
) -> dict[str, float]:
    """Run the demo in ``workdir``; print and return a summary.

    Reads ``windows_per_item`` random 10 s windows per item and epoch through
    :class:`~zstore.WindowLoader` with the node cache, and the same windows by h5py
    hyperslab reads of the HDF5 file, epoch by epoch, so the first epoch (which fills
    the cache) stands beside the later ones and beside h5py."""
    from tqdm import tqdm

    os.makedirs(workdir, exist_ok=True)
    h5 = os.path.join(workdir, "speech.h5")
    store = os.path.join(workdir, "speech.zarr")
    spec = SyntheticSpec(items=items, min_seconds=8.0, max_seconds=30.0)
    if not os.path.exists(h5):
        make_synthetic(h5, spec, progress=True)
    report = convert(h5, store, rates={"wav": WAV_RATE, "act": ACT_RATE}, overwrite=True)
    print(report)
    ram_dir = (
        os.path.join("/dev/shm", f"zstore-demo-{os.getuid()}")
        if os.path.isdir("/dev/shm")
        else os.path.join(workdir, "ram-cache")
    )
    # No SSD tier: the store is on a local disk, read from it directly (the default for
    # such a store; an SSD tier halved epoch 0 and sped up no later epoch).
    cache = CacheConfig(ram_dir=ram_dir, ram_bytes="512MB", ssd_dir=None)
    clear_cache(cache)
    ds = WindowDataset(
        store, window_seconds=10.0, windows_per_item=windows_per_item, seed=0, cache=cache
    )
    loader = WindowLoader(ds, batch_size=batch_size, shuffle=True)
    rates, h5_rates, kernel = [], [], []
    with h5py.File(h5, "r") as f:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            t0, n, sys0 = time.perf_counter(), 0, _kernel_seconds()
            for batch in tqdm(loader, desc=f"epoch {epoch}", unit="batch"):
                n += batch["wav"].shape[0]
            rates.append(n / (time.perf_counter() - t0))
            kernel.append((_kernel_seconds() - sys0, time.perf_counter() - t0))
            h5_rates.append(_h5py_windows(f, ds, epoch))
    stats = cache_stats(cache)
    warm = max(rates[1:], default=rates[0])
    warm_h5 = max(h5_rates[1:], default=h5_rates[0])
    summary = {
        "windows_per_s_first": rates[0],
        "windows_per_s_last": rates[-1],
        "h5py_windows_per_s_first": h5_rates[0],
        "h5py_windows_per_s_last": h5_rates[-1],
        "kernel_seconds_first": kernel[0][0],
        "ram_hit_rate": stats["ram"]["hit_rate"],
        "origin_bytes": stats["origin"]["bytes"],
        "store_bytes": report.store_bytes,
        "hdf5_bytes": os.path.getsize(h5),
    }
    print("\nzstore demo summary")
    print(f"  {len(ds)} random 10 s windows per epoch (wav and act), the same ones read both ways")
    print(
        f"  windows/s by epoch: zstore WindowLoader {', '.join(f'{r:,.0f}' for r in rates)} "
        "(epoch 0 fills the cache; later epochs read it)"
    )
    print(
        "  zstore epoch time in the kernel: "
        + ", ".join(f"{k:.2f} of {t:.2f} s" for k, t in kernel)
        + " (mostly first touches of new memory: the RAM tier's shards, the batch buffers; "
        "slow where a virtual machine hands freed memory back to its host)"
    )
    print(
        f"  windows/s by epoch: h5py hyperslab reads {', '.join(f'{r:,.0f}' for r in h5_rates)} "
        "(the HDF5 file, in the page cache)"
    )
    print(
        f"  warm (best later epoch): zstore {warm:,.0f} vs h5py {warm_h5:,.0f} windows/s "
        f"({warm / warm_h5:.1f}x)"
    )
    print(
        f"  RAM tier hit rate {stats['ram']['hit_rate']:.1%}, RAM tier holds "
        f"{format_size(stats['ram'].get('bytes_on_disk', 0))}; no SSD tier (a store on a "
        "local disk is read from it directly)"
    )
    print(
        f"  read from the origin: {format_size(stats['origin']['bytes'])} in "
        f"{stats['origin']['requests']} requests"
    )
    for choice in stats.get("formats", {}).values():
        print(f"  RAM tier format: {choice['format']}: {choice['reason']}")
    print(
        f"  store {format_size(report.store_bytes)} vs HDF5 "
        f"{format_size(os.path.getsize(h5))} ({report.store_bytes / os.path.getsize(h5):.2f}x)"
    )
    if ram_dir.startswith("/dev/shm"):
        shutil.rmtree(ram_dir, ignore_errors=True)  # give the demo's RAM back
    return summary


def _kernel_seconds() -> float:
    """CPU seconds this process has spent in the kernel (every thread)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def _h5py_windows(f: h5py.File, ds: WindowDataset, epoch: int) -> float:
    """Windows/s reading ``ds``'s windows of ``epoch`` by h5py hyperslabs (``wav`` and
    ``act``, padded with zeros as zstore pads them), in a shuffled order."""
    names = ds.reader.open().manifest.items
    order = np.random.default_rng(epoch).permutation(len(ds))
    hop = WAV_RATE // ACT_RATE
    t0 = time.perf_counter()
    for i in order:
        w = ds.window((epoch, int(i)))
        group = f[names[w.item]]
        act = np.zeros((group["act"].shape[0], w.take + w.pad), dtype=np.float32)
        act[:, : w.take] = group["act"][:, w.start : w.start + w.take]
        wav = np.zeros((group["wav"].shape[0], (w.take + w.pad) * hop), dtype=np.float32)
        part = group["wav"][:, w.start * hop : (w.start + w.take) * hop]
        wav[:, : part.shape[1]] = part
    return len(order) / (time.perf_counter() - t0)
