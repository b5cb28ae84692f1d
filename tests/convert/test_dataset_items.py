"""Files of one dataset per recording (``/utt0``, ``/audio/utt1``): ``dataset_items``."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import assert_one_line_error, cli, manifest_of

import zstore


def flat_file(path: Path, seconds: list[float], under: str = "", seed: int = 0) -> dict:
    """Recordings as datasets of their own (mics, samples), with attributes."""
    rng = np.random.default_rng(seed)
    wavs = {}
    with h5py.File(path, "w") as f:
        for i, s in enumerate(seconds):
            name = f"{under}utt{seed}_{i}"
            wav = (rng.integers(-3000, 3000, (2, int(s * 16000))) / 32768).astype(np.float32)
            f[name] = wav
            f[name].attrs["speaker"] = f"s{i % 3}"
            wavs[name] = wav
    return wavs


@pytest.mark.parametrize("pack_seconds", [0.0, 10.0], ids=["own groups", "packed"])
def test_each_dataset_is_an_item(tmp_path, cache, pack_seconds):
    wavs = flat_file(tmp_path / "flat.h5", [2.0, 3.5, 5.0, 1.0])
    dst = tmp_path / "flat.zarr"
    report = zstore.convert(
        tmp_path / "flat.h5",
        dst,
        rates={"wav": 16000},
        dataset_items="wav",
        pack_seconds=pack_seconds,
        verify=True,
        progress=False,
    )
    assert report.items == 4 and report.packed == (4 if pack_seconds else 0)
    assert sorted(manifest_of(dst).items) == sorted(wavs)
    seen = {}
    for tiers in (False, cache, cache):
        ds = zstore.WindowDataset(
            dst, window_seconds=None, cache=tiers, items=lambda n, a: seen.setdefault(n, a) or True
        )
        for i in range(len(ds)):
            x = ds[i]
            np.testing.assert_array_equal(x["wav"].numpy(), wavs[x["item"]])
    assert {n: a["speaker"] for n, a in seen.items()} == {
        n: f"s{i % 3}" for i, n in enumerate(wavs)
    }  # the dataset's attributes are the item's
    again = zstore.convert(
        tmp_path / "flat.h5",
        dst,
        rates={"wav": 16000},
        dataset_items="wav",
        pack_seconds=pack_seconds,
        progress=False,
    )
    assert again.converted == 0


def test_datasets_under_a_group_and_an_append(tmp_path):
    first = flat_file(tmp_path / "a.h5", [2.0, 3.0], under="audio/", seed=1)
    with h5py.File(tmp_path / "a.h5", "a") as f:
        f["sample_rate"] = 16000  # a scalar beside the recordings: not one of them
    second = flat_file(tmp_path / "b.h5", [4.0], under="audio/", seed=2)
    dst = tmp_path / "s.zarr"
    proc = cli(
        "convert", str(tmp_path / "a.h5"), str(dst), "--rate", "wav=16000",
        "--dataset-items", "wav", "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "skipped sample_rate: 0-d, where 2 dataset(s) are 2-d recordings" in proc.stdout
    refused = cli("convert", str(tmp_path / "b.h5"), str(dst), "--append", "--dataset-items", "x")
    assert_one_line_error(refused, "--dataset-items x", "datasets holding 'wav'")
    zstore.append(tmp_path / "b.h5", dst, progress=False)  # the store's option
    assert "items: the source's datasets, each the array 'wav'" in cli("info", str(dst)).stdout
    ds = zstore.WindowDataset(dst, window_seconds=1.0, cache=False)
    assert sorted(ds._items) == sorted({**first, **second})
    for i in range(len(ds)):
        x = ds[i]
        start = round(x["start"] * 16000)
        want = {**first, **second}[x["item"]][:, start : start + 16000]
        np.testing.assert_array_equal(x["wav"].numpy(), want)


def test_without_the_option_the_errors_name_it(tmp_path):
    flat_file(tmp_path / "root.h5", [2.0, 3.0])
    with pytest.raises(zstore.SourceError, match="2 numeric dataset.*--dataset-items wav"):
        zstore.convert(tmp_path / "root.h5", tmp_path / "a.zarr", progress=False)
    flat_file(tmp_path / "group.h5", [1.0, 2.0, 3.0, 4.0, 5.0], under="audio/")
    with pytest.raises(zstore.SourceError, match="each dataset of 'audio' is a recording"):
        zstore.convert(tmp_path / "group.h5", tmp_path / "b.zarr", progress=False)
    with pytest.raises(zstore.SourceError, match="--dataset-items 'a/b'"):
        zstore.convert(tmp_path / "group.h5", tmp_path / "c.zarr", dataset_items="a/b")


def test_features_dumped_one_dataset_per_utterance_frames_first(tmp_path):
    rng = np.random.default_rng(9)
    feats = {
        f"spk1-utt{i}": rng.standard_normal((100 * (2 + i), 80)).astype(np.float32)
        for i in range(4)
    }
    with h5py.File(tmp_path / "feats.h5", "w") as f:
        for name, x in feats.items():
            f[name] = x
    dst = tmp_path / "feats.zarr"
    zstore.convert(
        tmp_path / "feats.h5",
        dst,
        rates={"feats": 100},
        time_axis={"feats": 0},
        dataset_items="feats",
        progress=False,
    )
    ds = zstore.WindowDataset(dst, window_seconds=1.5, cache=False)
    for i in range(len(ds)):
        x = ds[i]
        start = round(x["start"] * 100)
        np.testing.assert_array_equal(x["feats"].numpy(), feats[x["item"]][start : start + 150])
