"""A stated precision for float arrays (``--precision wav=100dB``), and what the
converter says of the values it writes."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr
from conftest import assert_one_line_error, cli, manifest_of, write_h5

import zstore
from zstore.errors import SourceError
from zstore.format import (
    PRECISION_ATTR,
    bits_for_snr,
    round_mantissa,
    value_kind,
    within_rounding,
)
from zstore.testing.synthetic import SyntheticSpec, make_synthetic

FLOAT = SyntheticSpec(items=5, mics=2, speakers=2, min_seconds=2.0, max_seconds=5.0, audio="float")


@pytest.fixture(scope="module")
def float_h5(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("float") / "float.h5"
    make_synthetic(path, FLOAT)
    return path


@pytest.fixture(scope="module")
def rounded_store(float_h5) -> Path:
    dst = float_h5.parent / "p.zarr"
    proc = _verify(float_h5, dst, workers=2)
    assert proc.returncode == 0, proc.stderr
    (dst.parent / "report.txt").write_text(proc.stdout)
    return dst


def source_arrays(path: Path, name: str = "wav") -> dict[str, np.ndarray]:
    with h5py.File(path) as f:
        return {g: f[g][name][()] for g in f}


def adversarial(dtype, n: int = 200_000, seed: int = 0) -> np.ndarray:
    """Values across the exponent range, ties, subnormals, the largest finite values,
    zeros and non-finite values."""
    rng = np.random.default_rng(seed)
    info = np.finfo(dtype)
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-40, 40, n))).astype(dtype)
    x[:100] = info.smallest_subnormal * rng.integers(1, 1000, 100)
    x[100:110] = info.max
    x[110:120] = -info.max
    x[120:130] = 0.0
    x[130] = np.nan
    x[131], x[132] = np.inf, -np.inf
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bits", [1, 7, 12, 16, 20])
def test_rounding_stays_within_half_a_unit_and_matches_numcodecs_bitround(dtype, bits):
    x = adversarial(dtype)
    y = round_mantissa(x, bits)
    assert y.dtype == x.dtype and y is not x
    assert within_rounding(y, x, bits) == 0
    # the dropped bits are zero (finite values), non-finite values are kept
    drop = np.finfo(dtype).nmant - bits
    raw = y.view(np.uint32 if dtype == np.float32 else np.uint64)
    finite = np.isfinite(y) & (np.abs(x) < np.finfo(dtype).max / 2)
    assert not np.any(raw[finite] & ((1 << drop) - 1))
    assert np.isnan(y[130]) and y[131] == np.inf and y[132] == -np.inf
    # the same as numcodecs' BitRound, an independent implementation of the same rounding
    from numcodecs import BitRound

    ours = np.abs(x) < np.finfo(dtype).max / 2
    theirs = BitRound(keepbits=bits).encode(x.copy()).view(dtype)
    assert np.array_equal(y[ours], theirs[ours], equal_nan=True)
    # rounding to fewer bits moves a value out of the bound of more bits
    if bits < 20:
        assert within_rounding(round_mantissa(x, bits), x, bits + 2) > 0


@pytest.mark.parametrize("db", [40, 60, 80, 96, 100, 110, 120])
def test_a_target_snr_becomes_bits_that_guarantee_it(db):
    bits = bits_for_snr(db)
    assert 20 * math.log10(2 ** (bits + 1)) >= db > 20 * math.log10(2**bits)
    # worst case: values just under the point where rounding moves them most
    rng = np.random.default_rng(db)
    raw = rng.standard_normal(100_000).view(np.uint64)
    drop = 52 - bits
    raw = (raw & ~np.uint64((1 << drop) - 1)) | np.uint64((1 << (drop - 1)) - 1)
    x = raw.view(np.float64)
    y = round_mantissa(x, bits)
    snr = 10 * math.log10(np.sum(x**2) / np.sum((y - x) ** 2))
    assert snr >= db


def test_synthetic_float_audio_is_true_float_and_int16_audio_unchanged(tmp_path):
    f = tmp_path / "f.h5"
    make_synthetic(f, FLOAT)
    wav = source_arrays(f)
    assert all(value_kind(w) == "float" and w.dtype == np.float32 for w in wav.values())
    again = tmp_path / "g.h5"
    make_synthetic(again, FLOAT)
    assert all(np.array_equal(w, source_arrays(again)[k]) for k, w in wav.items())
    i = tmp_path / "i.h5"
    make_synthetic(i, SyntheticSpec(items=2, mics=2, min_seconds=1, max_seconds=2))
    assert all(value_kind(w) == "int16" for w in source_arrays(i).values())
    with pytest.raises(ValueError, match="audio="):
        SyntheticSpec(audio="pcm")


def test_value_kinds():
    pcm = np.arange(-32768, 32768, dtype=np.int32).astype(np.float32) / 32768
    assert value_kind(pcm) == "int16"
    assert value_kind(pcm * 2**-8) == "int24"
    assert value_kind(np.array([0.0, 1.0, 7.0, -3.0], dtype=np.float32)) == "whole"
    assert value_kind(np.float32([0.1, 0.2])) == "float"
    late = pcm.copy()
    late[-1] = 0.1  # after the first slice: every value is checked
    assert value_kind(late) == "float"


def test_a_stated_precision_is_applied_recorded_and_read_by_every_reader(float_h5, rounded_store):
    ts = pytest.importorskip("tensorstore")
    dst, src = rounded_store, source_arrays(float_h5)
    manifest = manifest_of(dst)
    p = manifest.arrays["wav"].precision
    assert p is not None and p.bits == 16 and p.stated == "100dB"
    assert manifest.arrays["wav"].values == "float" and manifest.arrays["act"].precision is None
    assert p.snr_db is not None and 100 <= p.snr_db < 130
    ds = zstore.WindowDataset(dst, window_seconds=None, cache=False)
    root = zarr.open_group(dst, mode="r")
    assert len(ds) == len(src)
    for i in range(len(ds)):
        sample = ds[i]
        item = sample["item"]
        want = round_mantissa(src[item], 16)
        assert not np.array_equal(want, src[item])
        assert np.array_equal(sample["wav"].numpy(), want)
        assert np.array_equal(root[f"{item}/wav"][...], want)
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(dst / item / "wav")}}
        assert np.array_equal(ts.open(spec, read=True).result().read().result(), want)
        meta = json.loads((dst / item / "wav" / "zarr.json").read_text())
        assert meta["attributes"][PRECISION_ATTR]["mantissa_bits"] == 16
        assert (
            PRECISION_ATTR
            not in json.loads((dst / item / "act" / "zarr.json").read_text())["attributes"]
        )
        with h5py.File(float_h5) as f:  # arrays not named keep their exact values
            assert np.array_equal(root[f"{item}/act"][...], f[item]["act"][()])
    report = (dst.parent / "report.txt").read_text()
    assert "kept to 16 mantissa bits" in report and "measured SNR" in report
    assert "within the stated rounding" in report


def test_a_stated_precision_makes_true_float_audio_smaller(float_h5, rounded_store, tmp_path):
    lossless = zstore.convert(
        float_h5, tmp_path / "l.zarr", rates={"wav": 16000}, workers=1, progress=False
    )
    rounded = manifest_of(rounded_store).extra["store_bytes"]
    assert rounded < 0.85 * lossless.store_bytes
    assert "true float32 values, stored lossless" in lossless.values["wav"]
    assert "--precision wav=16bits would give" in lossless.values["wav"]
    ds = zstore.WindowDataset(tmp_path / "l.zarr", window_seconds=None, cache=False)
    src = source_arrays(float_h5)
    assert len(ds) == len(src)
    assert all(np.array_equal(s["wav"].numpy(), src[s["item"]]) for s in ds)


def test_info_shows_precision_and_measured_snr(rounded_store):
    proc = cli("info", str(rounded_store))
    assert proc.returncode == 0, proc.stderr
    assert "precision 16 mantissa bits (stated 100dB" in proc.stdout
    assert "measured SNR" in proc.stdout and "true float values" in proc.stdout
    info = json.loads(cli("info", str(rounded_store), "--json").stdout)
    assert info["arrays"]["wav"]["precision"]["mantissa_bits"] == 16
    assert info["arrays"]["wav"]["values"] == "float"


def _tamper(dst: Path, float_h5: Path, item: str, values) -> None:
    arr = zarr.open_array(dst / item / "wav", mode="r+")
    arr[...] = values(source_arrays(float_h5)[item])


def _verify(float_h5: Path, dst: Path, spec: str = "wav=100dB", workers: int = 1):
    """Convert (or rerun on) ``dst`` with ``--verify``, one group per item (the per-item
    objects are what these tests look at; packed items: test_packed.py)."""
    return cli("convert", str(float_h5), str(dst), "--rate", "wav=16000", "--precision", spec,
               "--verify", "--no-progress", "--workers", str(workers), "--pack-seconds", "0")  # fmt: skip


def test_verify_checks_values_within_the_stated_rounding(float_h5, tmp_path):
    dst = tmp_path / "p.zarr"
    assert _verify(float_h5, dst).returncode == 0
    item = sorted(source_arrays(float_h5))[1]
    # stored more precisely than stated: other bytes, every value within the rounding
    _tamper(dst, float_h5, item, lambda x: round_mantissa(x, 20))
    ok = _verify(float_h5, dst)
    assert ok.returncode == 0, ok.stderr
    # rounded coarser than stated: named, with the array and the precision
    _tamper(dst, float_h5, item, lambda x: round_mantissa(x, 12))
    bad = _verify(float_h5, dst)
    assert_one_line_error(bad, "verification failed", f"{item}/wav", "16 mantissa bits")
    # truncated instead of rounded: up to a whole unit off, also beyond the bound
    drop = 23 - 16
    _tamper(dst, float_h5, item, lambda x: (x.view(np.uint32) >> drop << drop).view(np.float32))
    assert_one_line_error(_verify(float_h5, dst), "verification failed", f"{item}/wav")


def test_an_append_applies_the_stores_precision(float_h5, tmp_path):
    dst = tmp_path / "p.zarr"
    assert _verify(float_h5, dst).returncode == 0
    before = manifest_of(dst).arrays["wav"].precision
    new = tmp_path / "new.h5"
    make_synthetic(new, dataclasses.replace(FLOAT, items=2, seed=7))
    with h5py.File(new, "a") as f:  # names the store does not have
        for g in list(f):
            f.move(g, f"more_{g}")
    refused = cli("convert", str(new), str(dst), "--append", "--precision", "wav=12bits",
                  "--no-progress")  # fmt: skip
    assert_one_line_error(refused, "--precision wav=12bits", "16 mantissa bits")
    proc = cli("convert", str(new), str(dst), "--append", "--verify", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "kept to 16 mantissa bits" in proc.stdout
    after = manifest_of(dst).arrays["wav"].precision
    assert after is not None and after.bits == 16 and after.signal > before.signal
    ds = zstore.WindowDataset(dst, window_seconds=None, cache=False)
    got = {s["item"]: s["wav"].numpy() for s in ds}
    src = source_arrays(new)
    assert len(got) == 7
    for g, x in src.items():
        assert np.array_equal(got[g], round_mantissa(x, 16))
    same = cli("convert", str(new), str(dst), "--append", "--precision", "wav=16bits")
    assert same.returncode == 0 and "already in the store" in same.stdout


def test_precision_is_refused_for_integer_unknown_and_malformed(tmp_path):
    src = tmp_path / "s.h5"
    rng = np.random.default_rng(0)
    write_h5(
        src,
        {
            f"rec{i}": {
                "wav": rng.standard_normal((1, n)).astype(np.float32),
                "pcm": rng.integers(-100, 100, (1, n)).astype(np.int16),
            }
            for i, n in enumerate([16000, 24000])
        },
    )
    dst = tmp_path / "out.zarr"
    cases = [
        ({"pcm": "16bits"}, ["'pcm' is int16", "float arrays only"]),
        ({"nope": "100dB"}, ["no array is named 'nope'"]),
        ({"wav": "16"}, ["wav=16bits", "wav=100dB"]),
        ({"wav": "0bits"}, ["mantissa bits"]),
        ({"wav": True}, ["mantissa bits"]),
    ]
    for precision, words in cases:
        with pytest.raises(SourceError) as e:
            zstore.convert(src, dst, rates={"wav": 16000, "pcm": 16000}, precision=precision,
                           workers=1, progress=False)  # fmt: skip
        assert all(w in str(e.value) for w in words), str(e.value)
        assert not dst.exists()
    proc = cli("convert", str(src), str(dst), "--rate", "wav=16000", "--precision", "pcm=8bits")
    assert_one_line_error(proc, "'pcm' is int16", "float arrays only")
    assert_one_line_error(
        cli("convert", str(src), str(dst), "--precision", "wav"), "NAME=VALUE", "wav=100dB"
    )
    assert not dst.exists()


def test_int16_valued_audio_is_said_and_unchanged_by_a_precision(tmp_path):
    src = tmp_path / "i.h5"
    make_synthetic(src, SyntheticSpec(items=3, mics=2, min_seconds=1, max_seconds=3))
    plain = zstore.convert(
        src, tmp_path / "a.zarr", rates={"wav": 16000}, workers=1, progress=False
    )
    assert "holding only int16 sample values" in plain.values["wav"]
    assert "whole numbers" in plain.values["act"]
    assert "int16 samples" in cli("info", str(tmp_path / "a.zarr")).stdout
    # int16 values need 15 mantissa bits at most: 16 bits keep every one
    kept = zstore.convert(
        src,
        tmp_path / "b.zarr",
        rates={"wav": 16000},
        precision={"wav": 16},
        workers=1,
        progress=False,
    )
    assert "no value moved" in kept.values["wav"]
    a = zstore.WindowDataset(tmp_path / "a.zarr", window_seconds=None, cache=False)
    b = zstore.WindowDataset(tmp_path / "b.zarr", window_seconds=None, cache=False)
    assert all(np.array_equal(a[i]["wav"].numpy(), b[i]["wav"].numpy()) for i in range(len(a)))
