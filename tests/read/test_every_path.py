"""Every read path gives the HDF5 file's values, bit for bit.

One corpus shaped like users' data, written by h5py: recordings of 0.3-77 s (the short
ones packed, those under the window padded), stereo ``wav`` at 16 kHz, ``act`` at
100/s and a float16 ``emb`` at 50/s; ``wav`` int16-valued in one corpus (one recording
holding a NaN and a -0.0, which int16 cannot hold) and partly true float in the other.
Each cache configuration (no tiers; RAM tiers large, small enough to displace, encoded;
a remote origin read by ranges with the fills' chunks fetched behind the reads; whole
shards into an SSD tier, with and without a RAM tier) reads three epochs through
WindowLoader, cold then warm, and random windows by ``ds[i]``; every window is compared
with h5py's hyperslab of the same item and span.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import zstore
from zstore.testing import ModelledFileSystem

WINDOW = 2.0
RATES = {"wav": 16000, "act": 100, "emb": 50}  # emb's 50/s is the coarse grid
SECONDS = (0.3, 0.9, 1.5, 2.5, 4.0, 7.0, 12.0, 31.0, 75.0)


def _corpus(path: Path, seed: int, int16_only: bool) -> str:
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        for i in range(24):
            frames = int(round((float(rng.choice(SECONDS)) + rng.integers(0, 50) / 50) * 50))
            if int16_only or rng.integers(0, 3):
                pcm = rng.integers(-32768, 32768, (2, frames * 320))
                wav = (pcm / 32768).astype(np.float32)
            else:  # processed audio
                wav = rng.normal(0, 0.1, (2, frames * 320)).astype(np.float32)
            if i == 7:  # what no int16 sample is: the RAM tier must keep the floats
                wav[0, 5], wav[1, -3] = -0.0, np.nan
            g = f.create_group(f"rec{i:03d}")
            g["wav"] = wav
            g["act"] = (rng.random((3, frames * 2)) > 0.5).astype(np.float32)
            g["emb"] = rng.normal(0, 1, (4, frames)).astype(np.float16)
    return str(path)


@pytest.fixture(scope="module", params=["int16-valued", "mixed"])
def corpus(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    where = tmp_path_factory.mktemp(request.param)
    h5 = _corpus(where / "c.h5", 11, request.param == "int16-valued")
    store = str(where / "c.zarr")
    zstore.convert(h5, store, rates=RATES, workers=1, progress=False)
    with h5py.File(h5, "r") as f:
        yield store, f


def _expected(f: h5py.File, item: str, start: float, length: int) -> dict[str, np.ndarray]:
    """The window of ``item`` from ``start`` s, ``length`` frames of 50/s real, as h5py
    reads it, padded with zeros to the window."""
    out = {}
    for name, rate in RATES.items():
        first, take = round(start * rate), length * rate // 50
        part = f[item][name][:, first : first + take]
        assert part.shape[1] == take
        window = np.zeros((part.shape[0], round(WINDOW * rate)), dtype=part.dtype)
        window[:, :take] = part
        out[name] = window
    return out


def _differs(got: np.ndarray, want: np.ndarray) -> bool:
    return got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes()


def _config(tmp_path: Path, **kw: Any) -> zstore.CacheConfig:
    kw.setdefault("ram_dir", tmp_path / "ram")
    kw.setdefault("ssd_dir", None)
    return zstore.CacheConfig(**kw)


CONFIGS: dict[str, tuple[Callable[[Path], Any], bool]] = {
    "no tiers": (lambda p: False, False),
    "RAM": (lambda p: _config(p, ram_bytes="1GB"), False),
    "RAM small (displacing builds)": (lambda p: _config(p, ram_bytes="4MB"), False),
    "RAM encoded": (lambda p: _config(p, ram_bytes="1GB", ram_format="encoded"), False),
    "remote, RAM (fill chunks behind)": (lambda p: _config(p, ram_bytes="1GB"), True),
    "remote, RAM small": (lambda p: _config(p, ram_bytes="6MB"), True),
    "remote, RAM + SSD (whole shards)": (
        lambda p: _config(p, ram_bytes="1GB", ssd_dir=p / "ssd", ssd_bytes="2GB"),
        True,
    ),
    "remote, SSD only": (
        lambda p: _config(p, ram_dir=None, ram_bytes=0, ssd_dir=p / "ssd", ssd_bytes="2GB"),
        True,
    ),
    "remote, RAM + SSD by ranges": (
        lambda p: _config(p, ram_bytes="1GB", ssd_dir=p / "ssd", ssd_bytes="2GB", fetch="range"),
        True,
    ),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_window_on_every_path_is_the_hdf5_files(corpus: Any, tmp_path: Path, config: str):
    store, f = corpus
    make, remote = CONFIGS[config]
    with pytest.warns(UserWarning, match="padded with zeros"):
        ds = zstore.WindowDataset(
            store,
            window_seconds=WINDOW,
            windows_per_item=2,
            seed=5,
            cache=make(tmp_path),
            origin_fs=ModelledFileSystem() if remote else None,
        )
    wrong: list[str] = []
    seen = 0
    loader = zstore.WindowLoader(ds, batch_size=8, shuffle=True, seed=3)
    for epoch in range(3):  # the first fills the tiers (behind the reads), then hits
        loader.set_epoch(epoch)
        for batch in loader:
            for row, item in enumerate(batch["item"]):
                want = _expected(f, item, float(batch["start"][row]), int(batch["length"][row]))
                for name in RATES:
                    seen += 1
                    if _differs(batch[name][row].numpy(), want[name]):
                        wrong.append(f"epoch {epoch}, {item} {name} from {batch['start'][row]} s")
        ds.settle(timeout=60)
    assert seen == 3 * len(ds) * len(RATES)
    ds.set_epoch(7)
    for i in random.Random(1).sample(range(len(ds)), 16):
        x = ds[i]
        want = _expected(f, x["item"], float(x["start"]), int(x["length"]))
        wrong += [f"ds[{i}] {x['item']} {n}" for n in RATES if _differs(x[n].numpy(), want[n])]
    assert not wrong, f"{len(wrong)} windows differ from the HDF5 file: {wrong[:5]}"
