"""``zstore demo``: generate a small HDF5 file, convert it, read windows through the cache."""

from __future__ import annotations

import os
import shutil
import time

import torch

from zstore.cache import CacheConfig, cache_stats, clear_cache
from zstore.convert import convert
from zstore.testing import ACT_RATE, WAV_RATE, SyntheticSpec, make_synthetic
from zstore.train import WindowDataset
from zstore.units import format_size


def run_demo(
    workdir: str = "zstore-demo",
    *,
    items: int = 16,
    epochs: int = 3,
    workers: int = 2,
    batch_size: int = 4,
) -> dict[str, float]:
    """Run the demo in ``workdir``; print and return a summary."""
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
    cache = CacheConfig(
        ram_dir=ram_dir,
        ram_bytes="512MB",
        ssd_dir=os.path.join(workdir, "ssd-cache"),
        ssd_bytes="1GB",
    )
    clear_cache(cache)
    ds = WindowDataset(store, window_seconds=10.0, seed=0, cache=cache)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=batch_size, num_workers=workers, shuffle=True
    )
    rates = []
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        t0, n = time.perf_counter(), 0
        for batch in tqdm(loader, desc=f"epoch {epoch}", unit="batch"):
            n += batch["wav"].shape[0]
        rates.append(n / (time.perf_counter() - t0))
    stats = cache_stats(cache)
    summary = {
        "windows_per_s_first": rates[0],
        "windows_per_s_last": rates[-1],
        "ram_hit_rate": stats["ram"]["hit_rate"],
        "ssd_hit_rate": stats["ssd"]["hit_rate"],
        "origin_bytes": stats["origin"]["bytes"],
        "store_bytes": report.store_bytes,
        "hdf5_bytes": os.path.getsize(h5),
    }
    print("\nzstore demo summary")
    print(
        f"  windows/s by epoch: {', '.join(f'{r:.0f}' for r in rates)} "
        f"(epoch 0 fills the cache; later epochs read it)"
    )
    print(
        f"  RAM tier hit rate {stats['ram']['hit_rate']:.1%}, SSD tier hit rate "
        f"{stats['ssd']['hit_rate']:.1%}, RAM tier holds "
        f"{format_size(stats['ram'].get('bytes_on_disk', 0))}"
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
