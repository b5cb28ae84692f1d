"""Rates that are not whole numbers: TTS-style corpora (``wav`` at 22,050/s beside
``mel`` frames of a 256-sample hop, 86.1328125 frames/s), converted through the CLI
with the rate written as a ratio, read back as windows aligned across both arrays."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from conftest import assert_one_line_error, cli, write_h5

import zstore

SR, HOP = 22050, 256


@pytest.fixture(scope="module")
def tts_h5(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Six utterances of 2-8 s: int16-valued float ``wav`` and a centred STFT's ``mel``
    (80, 1 + samples // 256) of true float values."""
    rng = np.random.default_rng(7)
    items = {}
    for i in range(6):
        n = int(rng.integers(2 * SR, 8 * SR))
        items[f"LJ{i:03d}"] = {
            "wav": (rng.integers(-3000, 3000, n) / 32768).astype(np.float32),
            "mel": rng.standard_normal((80, 1 + n // HOP)).astype(np.float32),
        }
    return write_h5(tmp_path_factory.mktemp("tts") / "tts.h5", items)


@pytest.mark.parametrize("pack", ["0", "10"])
def test_a_rate_written_as_a_ratio_gives_aligned_windows(tts_h5, tmp_path, pack):
    store = str(tmp_path / "tts.zarr")
    done = cli(
        "convert", tts_h5, store, "--rate", f"wav={SR}", "--rate", f"mel={SR}/{HOP}",
        "--pack-seconds", pack, "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "mel: time array at 86.1328/s" in done.stdout
    info = json.loads(cli("info", store, "--json").stdout)
    rates = {name: a["rate"] for name, a in info["arrays"].items()}
    assert rates == {"wav": SR, "mel": SR / HOP}  # 86.1328125, exactly
    cache = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="64MB")
    ds = zstore.WindowDataset(store, window_seconds=1.0, seed=3, cache=cache)
    with h5py.File(tts_h5) as f:
        for epoch in range(2):  # a cold epoch, then one from the RAM tier
            ds.set_epoch(epoch)
            for i in range(len(ds)):
                w = ds[i]
                start = round(w["start"] * SR)
                assert start % HOP == 0, (w["item"], start)  # on the frame grid
                frames = w["mel"].shape[-1]
                assert w["wav"].shape[-1] == frames * HOP and frames == 86
                g = f[w["item"]]
                np.testing.assert_array_equal(w["wav"], g["wav"][start : start + frames * HOP])
                np.testing.assert_array_equal(
                    w["mel"], g["mel"][:, start // HOP : start // HOP + frames]
                )
        loader = zstore.WindowLoader(ds, batch_size=4, shuffle=True)
        for batch in loader:
            for k, item in enumerate(batch["item"]):
                start = round(float(batch["start"][k]) * SR)
                frames = batch["mel"].shape[-1]
                got = batch["mel"][k].numpy()
                np.testing.assert_array_equal(
                    got, f[item]["mel"][:, start // HOP : start // HOP + frames]
                )


@pytest.mark.parametrize("rate", ["mel=22050/0", "mel=22050/x", "mel=/256", "mel=1/2/3"])
def test_a_ratio_that_is_not_a_rate_is_one_line(tts_h5, tmp_path, rate):
    proc = cli(
        "convert", tts_h5, str(tmp_path / "x.zarr"), "--rate", f"wav={SR}", "--rate", rate,
        "--no-progress",
    )  # fmt: skip
    assert_one_line_error(proc, f"--rate {rate!r}", "is not a rate", "22050/256")
    assert not (tmp_path / "x.zarr").exists()
