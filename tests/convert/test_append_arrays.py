"""An append may bring arrays the store lacks (an embedding, a label, a new feature
track): the items before it lack them, as items of a store converted from groups of
unlike arrays do, and every value reads back equal, whole and as windows."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_error, cli, manifest_of, write_h5

import zstore
from zstore.format import round_mantissa


def speech(seed: int, names: list[str], seconds: float, extra: bool) -> dict:
    """Groups of int16-valued float ``wav`` (2 mics, 16 kHz; the k-th ``seconds`` x
    (1 + k / 2) long); with ``extra``, also a
    true-float speaker embedding ``emb`` (192,), frame activity ``act`` (2, 100/s) and
    a scalar int ``label``."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, name in enumerate(names):
        n = int(seconds * (1 + k / 2) * 16000)  # items of several lengths
        arrays = {"wav": rng.integers(-3000, 3000, (2, n)).astype(np.float32)}
        if extra:
            arrays["emb"] = rng.standard_normal(192).astype(np.float32)
            arrays["act"] = (rng.random((2, n // 160)) > 0.5).astype(np.float32)
            arrays["label"] = np.array(int(rng.integers(0, 40)), dtype=np.int64)
        out[name] = arrays
    return out


def stores(tmp_path: Path, seconds: float, pack_seconds: float):
    old = speech(1, ["r0", "r1", "r2"], seconds, extra=False)
    new = speech(2, ["n0", "n1"], seconds, extra=True)
    dst = tmp_path / f"s{pack_seconds:g}.zarr"
    zstore.convert(
        write_h5(tmp_path / "base.h5", old),
        dst,
        rates={"wav": 16000},
        workers=1,
        progress=False,
        pack_seconds=pack_seconds,
    )
    return dst, old, new


@pytest.mark.parametrize("seconds, pack_seconds", [(4.0, 0), (1.5, 10.0)])
def test_an_append_adds_arrays_the_store_lacks(tmp_path, seconds, pack_seconds):
    dst, old, new = stores(tmp_path, seconds, pack_seconds)
    before = zstore.WindowDataset(dst, window_seconds=None, cache=False)
    src = write_h5(tmp_path / "new.h5", new)
    report = zstore.append(src, dst, rates={"act": 100}, workers=1, progress=False)
    assert report.converted == 2
    manifest = manifest_of(dst)
    assert list(manifest.arrays) == ["wav", "act", "emb", "label"]  # the new ones by name
    assert manifest.arrays["act"].rate == 100 and manifest.arrays["emb"].rate is None
    assert list(manifest.items) == ["r0", "r1", "r2", "n0", "n1"]
    everything = {**old, **new}
    cache = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="256MB", ssd_dir=None)
    for tiers in (False, cache, cache):  # no tiers; cold tiers; warm tiers
        ds = zstore.WindowDataset(dst, window_seconds=None, cache=tiers, fields=["wav"])
        got = {ds[i]["item"]: ds[i]["wav"].numpy() for i in range(len(ds))}
        assert set(got) == set(everything)
        for name, arrays in everything.items():
            assert np.array_equal(got[name], arrays["wav"]), name
        fields = ["wav", "emb", "act", "label"]
        with pytest.warns(UserWarning, match="3 of 5 item.*lack"):
            ds = zstore.WindowDataset(
                dst, window_seconds=None, cache=tiers, fields=fields, missing="skip"
            )
        assert len(ds) == 2
        for i in range(2):
            w = ds[i]
            for f in fields:
                assert np.array_equal(np.asarray(w[f]), new[w["item"]][f]), (w["item"], f)
        # windows: act's frames aligned with wav's samples
        with pytest.warns(UserWarning, match="3 of 5 item.*lack"):
            ds = zstore.WindowDataset(
                dst, window_seconds=1.0, cache=tiers, fields=["wav", "act"], missing="skip"
            )
        for i in range(len(ds)):
            w = ds[i]
            start = round(float(w["start"]) * 16000)  # seconds, on act's grid
            src_wav, src_act = new[w["item"]]["wav"], new[w["item"]]["act"]
            assert np.array_equal(w["wav"].numpy(), src_wav[:, start : start + 16000])
            frame = start // 160
            assert np.array_equal(w["act"].numpy(), src_act[:, frame : frame + 100])
    # the default fields are the time arrays every item has: wav, of all five items
    ds = zstore.WindowDataset(dst, window_seconds=None, cache=False)
    assert set(ds[0]) >= {"wav"} and "act" not in ds[0] and len(ds) == 5
    # a new array asked for (missing="error"): one error naming the items that lack it
    with pytest.raises(zstore.ConfigError, match="r0"):
        zstore.WindowDataset(dst, window_seconds=None, cache=False, fields=["wav", "act"])
    # a job opened before the append, and its workers, keep their view
    assert len(before) == 3 and before.fields in (None, ["wav"])
    worker = pickle.loads(pickle.dumps(before))
    assert {worker[i]["item"] for i in range(3)} == {"r0", "r1", "r2"}
    # a rerun adds nothing; a later file with some of the new arrays adds its items
    assert zstore.append(src, dst, rates={"act": 100}, workers=1, progress=False).converted == 0
    later = speech(3, ["m0"], seconds, extra=True)
    del later["m0"]["act"]
    zstore.append(write_h5(tmp_path / "later.h5", later), dst, workers=1, progress=False)
    with pytest.warns(UserWarning, match="3 of 6 item.*lack"):
        ds = zstore.WindowDataset(
            dst, window_seconds=None, cache=False, fields=["emb", "label"], missing="skip"
        )
    got = {ds[i]["item"]: ds[i] for i in range(len(ds))}
    assert set(got) == {"n0", "n1", "m0"}
    assert np.array_equal(got["m0"]["emb"].numpy(), later["m0"]["emb"])
    proc = cli("info", str(dst))
    assert proc.returncode == 0 and "emb" in proc.stdout and "act" in proc.stdout


def test_a_new_arrays_rate_is_given_or_inferred_and_checked(tmp_path):
    dst, _, new = stores(tmp_path, 4.0, 0)
    src = write_h5(tmp_path / "new.h5", new)
    before = {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    # a rate for an array neither the store nor the new items have is refused
    proc = cli("convert", src, str(dst), "--append", "--no-progress", "--rate", "nope=100")
    assert_one_line_error(proc, "nope", "neither")
    # the new array's dimensions disagree with each other across the new items
    odd = dict(new)
    odd["n1"] = {**new["n1"], "emb": np.zeros((2, 192), np.float32)}
    proc = cli("convert", write_h5(tmp_path / "odd.h5", odd), str(dst), "--append", "--no-progress")
    assert proc.returncode != 0 and "emb" in proc.stderr
    assert {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()} == before
    # without --rate, act's rate is inferred from its whole-number ratio to wav's; a
    # precision stated for a new float array rounds it
    proc = cli("convert", src, str(dst), "--append", "--no-progress", "--precision", "emb=10bits")
    assert proc.returncode == 0, proc.stderr
    manifest = manifest_of(dst)
    assert manifest.arrays["act"].rate == 100 and manifest.arrays["emb"].precision.bits == 10
    ds = zstore.WindowDataset(dst, window_seconds=None, cache=False, fields=["emb"], items=["n1"])
    assert np.array_equal(ds[0]["emb"].numpy(), round_mantissa(new["n1"]["emb"], 10))
    assert not np.array_equal(ds[0]["emb"].numpy(), new["n1"]["emb"])
    # once in the store, the new array's rate and form are the store's
    more = speech(4, ["k0"], 4.0, extra=True)
    more["k0"]["emb"] = more["k0"]["emb"].astype(np.float64)
    proc = cli("convert", write_h5(tmp_path / "more.h5", more), str(dst), "--append")
    assert_one_line_error(proc, "'k0/emb'", "float64", "float32")


def test_a_new_array_takes_the_conversions_one_time_axis(tmp_path):
    """A store converted with one time axis for all (``time_axis=0``: (samples, mics)
    files) gives it to an array an append brings; a 1-D array stored whole stays so."""
    rng = np.random.default_rng(5)

    def group(n: int, act: bool) -> dict:
        out = {
            "wav": rng.integers(-900, 900, (n, 2)).astype(np.float32),
            "spk": rng.standard_normal(8).astype(np.float32),  # 1-D: whole
        }
        if act:
            out["act"] = (rng.random((n // 160, 3)) > 0.5).astype(np.float32)
        return out

    base = write_h5(tmp_path / "b.h5", {"r0": group(32000, False), "r1": group(48000, False)})
    dst = tmp_path / "t.zarr"
    zstore.convert(
        base, dst, rates={"wav": 16000}, time_axis=0, workers=1, progress=False, pack_seconds=0
    )
    new = {"n0": group(32000, True), "n1": group(64000, True)}
    zstore.append(write_h5(tmp_path / "n.h5", new), dst, workers=1, progress=False)
    arrays = manifest_of(dst).arrays
    assert arrays["act"].rate == 100 and arrays["act"].time_axis == 0
    assert arrays["spk"].rate is None
    with pytest.warns(UserWarning, match="lack"):
        ds = zstore.WindowDataset(
            dst, window_seconds=1.0, fields=["wav", "act"], missing="skip", cache=False
        )
    for i in range(len(ds)):
        w = ds[i]
        start = round(float(w["start"]) * 16000)
        assert np.array_equal(w["wav"].numpy(), new[w["item"]]["wav"][start : start + 16000])
        frame = start // 160
        assert np.array_equal(w["act"].numpy(), new[w["item"]]["act"][frame : frame + 100])
    # an append that states one array's axis: the other new arrays still take the
    # conversion's one axis, not the last
    more = {"k0": group(32000, True), "k1": group(48000, True)}
    for g in more.values():
        g["feats"] = rng.standard_normal((g["wav"].shape[0] // 160, 4)).astype(np.float32)
    zstore.append(
        write_h5(tmp_path / "k.h5", more), dst, time_axis={"act": 0}, workers=1, progress=False
    )
    feats = manifest_of(dst).arrays["feats"]
    assert feats.rate == 100 and feats.time_axis == 0


def test_a_new_float_array_is_cast_as_the_append_says_and_later_appends_follow(tmp_path):
    """Two new files whose embeddings are float32 in one and float64 in the other: the
    scan's advice (``--dtype emb=float32``) is taken by the append, the store records
    the cast, and a later append casts its float64 embeddings the same way."""
    dst, _, _ = stores(tmp_path, 4.0, 0)
    rng = np.random.default_rng(8)

    def emb_file(name: str, group: str, dtype) -> tuple[str, np.ndarray]:
        emb = rng.standard_normal(24).astype(dtype)
        wav = rng.integers(-900, 900, (2, 48000)).astype(np.float32)
        return write_h5(tmp_path / name, {group: {"wav": wav, "emb": emb}}), emb

    b, emb_b = emb_file("b.h5", "b0", np.float32)
    c, emb_c = emb_file("c.h5", "c0", np.float64)
    proc = cli("convert", b, c, str(dst), "--append", "--no-progress")
    assert_one_line_error(proc, "emb", "--dtype emb=float32")
    proc = cli("convert", b, c, str(dst), "--append", "--no-progress", "--dtype", "emb=float32")
    assert proc.returncode == 0, proc.stderr
    manifest = manifest_of(dst)
    assert manifest.arrays["emb"].dtype == "float32"
    assert manifest.extra["dtypes"] == {"emb": "float32"}
    d, emb_d = emb_file("d.h5", "d0", np.float64)
    zstore.append(d, dst, workers=1, progress=False)  # cast as the store's were
    with pytest.warns(UserWarning, match="lack"):
        ds = zstore.WindowDataset(
            dst, window_seconds=None, fields=["emb"], missing="skip", cache=False
        )
    got = {ds[i]["item"]: ds[i]["emb"].numpy() for i in range(len(ds))}
    assert got.keys() == {"b0", "c0", "d0"} and all(v.dtype == np.float32 for v in got.values())
    assert np.array_equal(got["b0"], emb_b)
    assert np.array_equal(got["c0"], emb_c.astype(np.float32))
    assert np.array_equal(got["d0"], emb_d.astype(np.float32))
    # the store's own casts are stated, not changed: wav was not cast
    proc = cli("convert", d, str(dst), "--append", "--no-progress", "--dtype", "wav=float16")
    assert_one_line_error(proc, "--dtype", "the store has")
