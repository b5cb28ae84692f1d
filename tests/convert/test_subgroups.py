"""Groups inside a recording's group (``/utt0/audio`` beside ``/utt0/feats/mfcc``):
items of their own by default, with a warning; arrays of the recording with
``subgroups="arrays"`` (``--subgroups arrays``)."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from conftest import assert_one_line_error, cli, manifest_of, write_h5

import zstore

SEGS = np.dtype([("start", "f8"), ("end", "f8"), ("spk", "i4")])


def recordings(seed: int, n: int, prefix: str = "utt") -> dict[str, dict[str, np.ndarray]]:
    """Recordings as hand-written HDF5 keeps them: audio in the group, features and a
    table of segments in groups inside it, one of them two levels down."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        frames = int(rng.integers(150, 600))
        segs = np.zeros(3, SEGS)
        segs["start"], segs["end"], segs["spk"] = rng.random(3), rng.random(3) + 1, [1, 2, 3]
        out[f"spk{i % 2}/{prefix}{i}"] = {
            "audio": (rng.integers(-3000, 3000, (2, frames * 160)) / 32768).astype("f4"),
            "feats/mfcc": rng.standard_normal((frames, 13)).astype("f4"),
            "feats/prosody/pitch": rng.standard_normal(frames).astype("f4"),
            "labels/segs": segs,
        }
    return out


def test_by_default_a_subgroup_is_an_item_of_its_own_and_the_scan_says_so(tmp_path):
    src = write_h5(tmp_path / "n.h5", recordings(1, 3))
    with pytest.warns(
        UserWarning, match=r"9 group\(s\) holding datasets lie inside .*--subgroups arrays"
    ):
        report = zstore.convert(
            src, tmp_path / "s.zarr", rates={"audio": 16000}, workers=1, progress=False
        )
    assert report.items == 12  # each recording, its feats, feats/prosody and labels
    assert "spk0/utt0/feats" in manifest_of(tmp_path / "s.zarr").items


def test_subgroups_as_arrays_read_back_exactly_through_windows_and_a_cache(tmp_path):
    data = recordings(2, 4)
    src = write_h5(tmp_path / "n.h5", data)
    with h5py.File(src, "a") as f:  # attributes of the subgroups' datasets go with them
        for name in data:
            f[name]["feats/mfcc"].attrs["hop"] = 160
            f[name]["labels/segs"].attrs["unit"] = "s"
    dst = tmp_path / "s.zarr"
    proc = cli(
        "convert", src, str(dst), "--rate", "audio=16000", "--subgroups", "arrays",
        "--time-axis", "feats.mfcc=0", "--verify", "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "inside another" not in proc.stderr
    assert "feats.prosody.pitch: time array at 100/s (inferred)" in proc.stdout
    manifest = manifest_of(dst)
    assert sorted(manifest.items) == sorted(data)
    assert manifest.extra["subgroups"] == "arrays"
    fields = ["audio", "feats.mfcc", "feats.prosody.pitch", "labels.segs.start", "labels.segs.spk"]
    cache = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=None)
    ds = zstore.WindowDataset(dst, window_seconds=None, fields=fields, cache=cache)
    for i in range(len(ds)):
        x = ds[i]
        want = data[x["item"]]
        assert np.array_equal(x["audio"].numpy(), want["audio"])
        assert np.array_equal(x["feats.mfcc"].numpy(), want["feats/mfcc"])
        assert np.array_equal(x["feats.prosody.pitch"].numpy(), want["feats/prosody/pitch"])
        assert np.array_equal(x["labels.segs.start"].numpy(), want["labels/segs"]["start"])
        assert np.array_equal(x["labels.segs.spk"].numpy(), want["labels/segs"]["spk"])
    windows = zstore.WindowDataset(dst, window_seconds=1.0, fields=fields[:3], cache=cache, seed=3)
    for i in range(len(windows)):
        x = windows[i]
        want = data[x["item"]]
        a, f = round(float(x["start"]) * 16000), round(float(x["start"]) * 100)
        assert np.array_equal(x["audio"].numpy(), want["audio"][:, a : a + 16000])
        assert np.array_equal(x["feats.mfcc"].numpy(), want["feats/mfcc"][f : f + 100])
        assert np.array_equal(
            x["feats.prosody.pitch"].numpy(), want["feats/prosody/pitch"][f : f + 100]
        )
    records = [json.loads(p.read_text()) for p in dst.glob("zstore_packed/*/items.*.json")]
    kept = {n: e.get("arrays") for r in records for n, e in r["entries"].items()}
    table = {"unit": "s"}  # a compound's attributes go with each of its fields
    assert kept == {
        name: {"feats.mfcc": {"hop": 160}, **{f"labels.segs.{k}": table for k in SEGS.names}}
        for name in data
    }
    info = cli("info", str(dst))
    assert "--subgroups arrays" in info.stdout
    assert json.loads(cli("info", str(dst), "--json").stdout)["subgroups"] == "arrays"


def test_an_append_reads_its_files_as_the_store_was_made(tmp_path):
    src = write_h5(tmp_path / "a.h5", recordings(3, 2))
    dst = tmp_path / "s.zarr"
    zstore.convert(
        src, dst, rates={"audio": 16000}, subgroups="arrays", workers=1, progress=False,
        time_axis={"feats.mfcc": 0},
    )  # fmt: skip
    more = recordings(4, 2, prefix="late")
    new = write_h5(tmp_path / "b.h5", more)
    refused = cli("convert", new, str(dst), "--append", "--subgroups", "items")
    assert_one_line_error(refused, "--subgroups items", "the store has groups inside items")
    report = zstore.append(new, dst, workers=1, progress=False)
    assert report.converted == 2
    ds = zstore.WindowDataset(dst, window_seconds=None, fields=["feats.mfcc"], cache=False)
    got = {ds[i]["item"]: ds[i]["feats.mfcc"].numpy() for i in range(len(ds))}
    assert len(got) == 4
    for name, arrays in more.items():
        assert np.array_equal(got[name], arrays["feats/mfcc"])


def test_a_subgroup_dataset_whose_name_is_taken_is_skipped_and_said(tmp_path):
    src = tmp_path / "c.h5"
    with h5py.File(src, "w") as f:
        for i in range(2):
            f[f"u{i}/audio"] = np.zeros((1, 32000 + i * 16000), "f4")
            f[f"u{i}/feats.x"] = np.arange(3, dtype="f4")
            f[f"u{i}/feats/x"] = np.ones(3, "f4")
            f[f"u{i}/feats/y"] = np.full(3, 2, "f4")
    with pytest.warns(UserWarning, match=r"u0/feats/x: inside item 'u0', whose array 'feats.x'"):
        zstore.convert(
            src, tmp_path / "s.zarr", rates={"audio": 16000}, subgroups="arrays", workers=1,
            progress=False, pack_seconds=0,
        )  # fmt: skip
    ds = zstore.WindowDataset(
        tmp_path / "s.zarr", window_seconds=None, fields=["feats.x", "feats.y"], cache=False
    )
    x = ds[0]
    assert np.array_equal(x["feats.x"].numpy(), np.arange(3)) and np.array_equal(
        x["feats.y"].numpy(), np.full(3, 2)
    )
    with pytest.raises(zstore.SourceError, match="subgroups='nested'"):
        zstore.convert(src, tmp_path / "t.zarr", rates={"audio": 16000}, subgroups="nested")
    proc = cli("convert", str(src), str(tmp_path / "u.zarr"), "--subgroups", "arrays",
               "--dataset-items", "wav")  # fmt: skip
    assert_one_line_error(proc, "--subgroups arrays and --dataset-items wav", "give one")
