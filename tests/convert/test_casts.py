"""Float arrays stored as another float dtype (``dtypes=`` / ``--dtype wav=float32``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr
from conftest import assert_one_line_error, cli, manifest_of, write_h5

import zstore


def processed(seed: int, seconds: list[float], dtypes: list[type]) -> dict:
    """Processed (true float) audio, float32 or float64 per recording, with frames."""
    rng = np.random.default_rng(seed)
    return {
        f"rec{seed}_{i}": {
            "wav": (rng.standard_normal((2, int(s * 16000))) * 0.1).astype(dt),
            "act": rng.random((2, int(s * 100))) > 0.5,
        }
        for i, (s, dt) in enumerate(zip(seconds, dtypes))
    }


def check_read(dst: Path, items: dict) -> None:
    ds = zstore.WindowDataset(dst, window_seconds=None, fields=["wav", "act"], cache=False)
    assert len(ds) == len(items)
    for i in range(len(ds)):
        x = ds[i]
        want = items[x["item"]]
        assert x["wav"].numpy().dtype == np.float32
        np.testing.assert_array_equal(x["wav"].numpy(), want["wav"].astype(np.float32))
        np.testing.assert_array_equal(x["act"].numpy(), want["act"])


@pytest.mark.parametrize("pack_seconds", [0.0, 10.0], ids=["own groups", "packed"])
def test_groups_of_float32_and_float64_are_stored_as_one_dtype(tmp_path, pack_seconds):
    items = processed(1, [2.0, 3.0, 4.0, 5.0], [np.float32, np.float64] * 2)
    src = write_h5(tmp_path / "mix.h5", items)
    with pytest.raises(zstore.SourceError, match="give --dtype wav=float32"):
        zstore.convert(src, tmp_path / "refused.zarr", rates={"wav": 16000}, progress=False)
    dst = tmp_path / "mix.zarr"
    report = zstore.convert(
        src,
        dst,
        rates={"wav": 16000},
        dtypes={"wav": "float32"},
        pack_seconds=pack_seconds,
        verify=True,
        progress=False,
    )
    assert report.packed == (4 if pack_seconds else 0)
    assert manifest_of(dst).arrays["wav"].dtype == "float32"
    assert "(cast from float64, to nearest), stored at" in report.values["wav"]
    check_read(dst, items)
    if not pack_seconds:  # core Zarr: zarr-python reads the cast values too
        root = zarr.open_group(dst, mode="r")
        np.testing.assert_array_equal(
            root["rec1_1/wav"][...], items["rec1_1"]["wav"].astype(np.float32)
        )


def test_float64_audio_and_its_appends_are_cast(tmp_path):
    first = processed(2, [2.0, 3.0], [np.float64] * 2)
    dst = tmp_path / "s.zarr"
    proc = cli(
        "convert", write_h5(tmp_path / "a.h5", first), str(dst), "--rate", "wav=16000",
        "--dtype", "wav=float32", "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    second = processed(3, [4.0], [np.float64])
    new = write_h5(tmp_path / "b.h5", second)
    refused = cli("convert", new, str(dst), "--append", "--dtype", "wav=float16")
    assert_one_line_error(refused, "--dtype", "casts", "float32")
    report = zstore.append(new, dst, progress=False, verify=True)  # cast as the store's
    assert report.converted == 1
    assert "wav: 16000/s, float32 (cast, --dtype)" in cli("info", str(dst)).stdout
    check_read(dst, {**first, **second})


def test_only_float_arrays_of_the_source_are_cast(tmp_path):
    src = write_h5(tmp_path / "a.h5", processed(4, [2.0, 3.0], [np.float64] * 2))
    with pytest.raises(zstore.SourceError, match="'act' is bool; only float arrays"):
        zstore.convert(src, tmp_path / "a.zarr", rates={"wav": 16000}, dtypes={"act": "float32"})
    with pytest.raises(zstore.SourceError, match="no array named 'spec'"):
        zstore.convert(src, tmp_path / "b.zarr", rates={"wav": 16000}, dtypes={"spec": "float32"})
    with pytest.raises(zstore.SourceError, match="one of float16, float32, float64"):
        zstore.convert(src, tmp_path / "c.zarr", rates={"wav": 16000}, dtypes={"wav": "int16"})


@pytest.mark.parametrize("pack_seconds", [0.0, 10.0], ids=["own groups", "packed"])
def test_values_beyond_the_new_dtype_stop_the_cast(tmp_path, pack_seconds):
    items = processed(5, [2.0, 3.0], [np.float64] * 2)
    items["rec5_1"]["wav"][0, 7] = 1e39  # finite in float64, infinite in float32
    items["rec5_0"]["wav"][0, 3] = np.inf  # infinities stay infinities: not refused
    src = write_h5(tmp_path / "a.h5", items)
    with pytest.raises(zstore.SourceError, match=r"rec5_1.* up to 1e\+39, beyond float32's"):
        zstore.convert(
            src,
            tmp_path / "a.zarr",
            rates={"wav": 16000},
            dtypes={"wav": "float32"},
            pack_seconds=pack_seconds,
            workers=1,
            progress=False,
        )
