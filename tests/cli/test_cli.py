"""The zstore command: cache stats | clear | warm, and the demo."""

from __future__ import annotations

import json
import re
import subprocess

from conftest import PYTHON, subprocess_env, zstore_cli

import zstore


def test_cache_warm_stats_clear(small_store, tmp_path):
    dirs = ["--ram-dir", str(tmp_path / "ram"), "--ssd-dir", str(tmp_path / "ssd")]
    sizes = ["--ram-bytes", "64MB", "--ssd-bytes", "64MB"]
    warm = zstore_cli("cache", "warm", small_store, "--no-progress", *dirs, *sizes)
    assert warm.returncode == 0, warm.stderr
    assert "warmed 6 items" in warm.stdout
    stats = zstore_cli("cache", "stats", "--json", *dirs, *sizes)
    data = json.loads(stats.stdout)
    assert data["ram"]["entries"] > 0 and data["origin"]["requests"] > 0
    assert data["ram"]["bytes_on_disk"] <= 64_000_000
    # After warming, a whole epoch reads nothing from the origin.
    cache = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=tmp_path / "ssd", ssd_bytes="64MB"
    )
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=cache)
    [ds[i] for i in range(len(ds))]
    assert zstore.cache_stats(cache)["origin"]["requests"] == data["origin"]["requests"]
    text = zstore_cli("cache", "stats", *dirs, *sizes)
    assert "ram:" in text.stdout and "hit rate" in text.stdout and "origin since" in text.stdout
    cleared = zstore_cli("cache", "clear", *dirs)  # budgets do not matter to clearing
    assert cleared.returncode == 0 and "cleared" in cleared.stdout
    after = json.loads(zstore_cli("cache", "stats", "--json", *dirs, *sizes).stdout)
    assert after["ram"]["entries"] == 0 and after["ssd"]["entries"] == 0
    assert after["origin"]["requests"] == 0


def test_cache_warm_names_fields_it_cannot_warm(tmp_path):
    import h5py
    import numpy as np

    with h5py.File(tmp_path / "a.h5", "w") as f:
        for i in range(3):
            f[f"u{i}/wav"] = np.zeros((1, 16000 * (1 + i)), np.float32)
            f[f"u{i}/label"] = np.int64(i)
    zstore.convert(
        str(tmp_path / "a.h5"), tmp_path / "a.zarr", rates={"wav": 16000}, progress=False
    )
    dirs = ["--ram-dir", str(tmp_path / "ram"), "--ram-bytes", "64MB", "--no-progress"]
    store = str(tmp_path / "a.zarr")
    whole = zstore_cli("cache", "warm", store, "--fields", "wav", "label", *dirs)
    assert whole.returncode == 2 and "'label' is stored whole (no time axis)" in whole.stderr
    assert "leave it out of --fields" in whole.stderr
    unknown = zstore_cli("cache", "warm", store, "--fields", "lbl", *dirs)
    assert unknown.returncode == 2 and "no array 'lbl' (arrays: wav, label)" in unknown.stderr
    warm = zstore_cli("cache", "warm", store, "--fields", "wav", *dirs)
    assert warm.returncode == 0 and "warmed 3 items" in warm.stdout


def test_cache_stats_reads_the_environment(tmp_path):
    env = {**subprocess_env(), "ZSTORE_RAM_DIR": str(tmp_path / "r"), "ZSTORE_SSD_DIR": "none"}
    proc = subprocess.run(
        [PYTHON, "-m", "zstore.cli", "cache", "stats", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    data = json.loads(proc.stdout)
    assert data["config"]["ram_dir"] == str(tmp_path / "r") and data["config"]["ssd_dir"] is None


def test_demo_runs_end_to_end(tmp_path):
    proc = zstore_cli("demo", "--dir", str(tmp_path / "demo"), "--items", "6", "--epochs", "2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "zstore demo summary" in out and "windows/s by epoch: zstore WindowLoader" in out
    assert "h5py hyperslab reads" in out and "warm (best later epoch): zstore" in out
    kernel = next(line for line in out.splitlines() if "epoch time in the kernel" in line)
    assert len(re.findall(r"\d\.\d\d of \d+\.\d\d s", kernel)) == 2  # one per epoch
    assert "RAM tier hit rate" in out and "read from the origin" in out
    assert "vs HDF5" in out
    assert "epoch 1" in proc.stderr  # the progress bars
