"""Float arrays of int16 samples (``x / 32768``, as read from 16-bit PCM) are kept as
int16 in the RAM tier's decoded shards, half the bytes, and read back bit for bit; true
float audio, and shards whose values are not all samples whatever the manifest says, stay
in their own dtype.  Real HDF5 files written by h5py, converted, read through the public
API."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from conftest import write_h5

import zstore
from zstore.format import Span, field_sizes
from zstore.read import streamcopy
from zstore.read.reader import WindowReader

RATES = {"wav": 16000, "act": 100}


def _recording(rng: np.random.Generator, seconds: float, kind: str) -> dict[str, np.ndarray]:
    n = int(seconds * 16000)
    if kind == "int16":  # 16-bit PCM read as float32, the loaders' x / 32768
        wav = rng.integers(-32768, 32768, size=(2, n), dtype=np.int16).astype(np.float32) / 32768
    else:  # processed audio: true float values
        wav = rng.standard_normal((2, n)).astype(np.float32) * 0.1
    act = (rng.random((2, n // 160)) > 0.5).astype(np.float32)
    return {"wav": wav, "act": act}


def _store(tmp_path: Path, kind: str, items: int = 3) -> tuple[str, dict[str, dict]]:
    rng = np.random.default_rng(5)
    data = {f"rec{i}": _recording(rng, 70.0 + 9 * i, kind) for i in range(items)}
    h5 = write_h5(tmp_path / f"{kind}.h5", data)
    dst = tmp_path / f"{kind}.zarr"
    zstore.convert(h5, dst, rates=RATES, workers=1, progress=False, pack_seconds=0)
    return str(dst), data


def _cache(tmp_path: Path) -> zstore.CacheConfig:
    return zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="256MB", ram_format="decoded", ssd_dir=None
    )


def _read_all(store: str, cache: zstore.CacheConfig, data: dict[str, dict], epoch: int) -> None:
    """Every window of an epoch equals the HDF5 source bit for bit."""
    ds = zstore.WindowDataset(
        store, window_seconds=7.0, seed=3, windows_per_item=4, cache=cache, fields=["wav", "act"]
    )
    check_epoch(ds, data, epoch)
    assert ds.settle(timeout=120)


def check_epoch(ds: zstore.WindowDataset, data: dict[str, dict], epoch: int) -> None:
    """Every window of ``ds``'s epoch equals the HDF5 source bit for bit: ``wav`` at
    16 kHz, every other field at 100 frames/s with time on its second axis."""
    ds.set_epoch(epoch)
    for i in range(len(ds)):
        w = ds[i]
        start, n = round(w["start"] * 100), int(w["length"])
        src = data[w["item"]]
        wav = w["wav"].numpy()[:, : n * 160]
        assert wav.dtype == np.float32
        want = src["wav"][:, start * 160 : (start + n) * 160]
        assert np.array_equal(wav.view(np.uint32), want.view(np.uint32)), (w["item"], start)
        for name in ds.fields:
            if name != "wav":
                got = w[name].numpy()[:, :n]
                assert np.array_equal(got, src[name][:, start : start + n]), (w["item"], name)


def _ram_bytes(cache: zstore.CacheConfig) -> int:
    return zstore.cache_stats(cache)["ram"]["fill_bytes"]


def _whole_store(store: str, cache: zstore.CacheConfig) -> None:
    """Every shard of the store into the RAM tier (``zstore cache warm``)."""
    zstore.warm(store, cache=cache, fields=["wav", "act"], workers=1, progress=False)


def test_int16_samples_take_half_the_ram_and_read_back_bit_for_bit(tmp_path):
    store, data = _store(tmp_path, "int16")
    cache = _cache(tmp_path)
    for epoch in (0, 0, 1):  # cold (filled behind the reads), warm, other windows
        _read_all(store, cache, data, epoch)
    float_bytes = sum(a.nbytes for rec in data.values() for a in rec.values())
    wav_bytes = sum(rec["wav"].nbytes for rec in data.values())
    # the values' headers and block checksums add ~0.01%
    assert 0 < _ram_bytes(cache) <= (float_bytes - wav_bytes // 2) * 1.001
    assert zstore.cache_stats(cache)["ram"]["hits"] > 0


def test_true_float_audio_stays_float_in_the_ram_tier(tmp_path):
    store, data = _store(tmp_path, "float")
    cache = _cache(tmp_path)
    for epoch in (0, 0):
        _read_all(store, cache, data, epoch)
    wav_bytes = sum(rec["wav"].nbytes for rec in data.values())
    assert _ram_bytes(cache) >= wav_bytes * 0.9  # every shard touched, as float32


def _claim_int16(store: str) -> None:
    """Edit the store's manifest to say wav holds int16 samples (what a sampled check of
    the values can conclude of an array with a few values that are not)."""
    path = Path(store) / "zarr.json"
    text = path.read_text()
    meta = json.loads(text)
    found = []

    def walk(node):
        if isinstance(node, dict):
            if "values" in node and "rate" in node and node.get("rate") == 16000:
                node["values"] = "int16"
                found.append(node)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(meta)
    assert found, "no 'values' entry for wav in the manifest"
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize("odd", ["fraction", "-0.0", "nan", "1.0"])
def test_values_that_are_not_samples_keep_their_shard_wide(tmp_path, caplog, odd):
    """A recording of int16 samples with one value that is not one (a fraction of a
    sample, -0.0, NaN, or +1.0 = 32768 samples), in the middle of a shard: the manifest
    says int16 samples, the shard is kept as float32 with that value, the other shards as
    int16, and every window reads the stored values bit for bit."""
    rng = np.random.default_rng(9)
    data = {f"rec{i}": _recording(rng, 75.0, "int16") for i in range(2)}
    value = {"fraction": 0.25 / 32768, "-0.0": -0.0, "nan": np.nan, "1.0": 1.0}[odd]
    data["rec1"]["wav"][1, 70 * 16000 + 17] = value  # in the second shard (64 s shards)
    h5 = write_h5(tmp_path / "odd.h5", data)
    store = str(tmp_path / "odd.zarr")
    zstore.convert(h5, store, rates=RATES, workers=1, progress=False, pack_seconds=0)
    _claim_int16(store)
    cache = _cache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="zstore"):
        _whole_store(store, cache)
    assert any("not int16 samples" in r.getMessage() for r in caplog.records)
    reader = WindowReader(store, cache=cache)
    for item in data:
        got = reader.read(item, {"wav": Span(0, 75 * 16000)})["wav"]
        want = data[item]["wav"]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), item
    stats = zstore.cache_stats(cache)["ram"]
    assert stats["hits"] > 0 and stats["corrupt"] == 0
    wav = sum(rec["wav"].nbytes for rec in data.values())
    # one shard of 11 s (rec1's second) kept as float32, the other three as int16
    assert wav // 2 < _ram_bytes(cache) < wav // 2 + 2 * 11 * 16000 * 4


def test_the_format_choice_weighs_int16_samples_at_their_ram_size(tmp_path):
    store, data = _store(tmp_path, "int16", items=2)
    reader = WindowReader(store)
    reader.open()
    sizes = field_sizes(reader.manifest, reader._metas, ["wav"])
    assert sizes.ram_bytes == sizes.decoded_bytes // 2
    # a budget that holds the int16 samples but not float32 ones: decoded, filled by the
    # reads (a local store is read by ranges)
    wav = sum(rec["wav"].nbytes for rec in data.values())
    cache = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes=int(wav * 0.6), ssd_dir=tmp_path / "ssd"
    )
    chosen = WindowReader(store, cache=cache, fields=["wav"]).open().format_choice
    assert chosen is not None and chosen.format == "chunks"
    assert "the decoded data fits" in chosen.reason


ODD = [np.nan, np.inf, -np.inf, -0.0, 1.0, -1.0 - 2.0**-15, 0.5 * 2.0**-15, 1e30]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("extension", [True, False])
def test_narrow_is_exact_or_says_no(monkeypatch, dtype, extension):
    if not extension:
        monkeypatch.setattr(streamcopy, "_narrow", None)
        monkeypatch.setattr(streamcopy, "_widen", None)
    elif streamcopy._narrow is None:
        pytest.skip("the C extension is not built here")
    rng = np.random.default_rng(1)
    samples = rng.integers(-32768, 32768, size=(3, 1001), dtype=np.int16)
    samples[0, :2] = [-32768, 32767]
    src = samples.astype(dtype) / 32768
    shard = np.zeros((3, 2000), dtype=np.int16)
    dst = shard[:, 500:1501]  # a strided part of a shard, as a chunk's place in it
    assert streamcopy.narrow(dst, src)
    assert np.array_equal(dst, samples) and not shard[:, :500].any()
    for stream in (False, True):
        back = np.zeros((3, 1500), dtype=dtype)[:, 3:1004]  # rows not 16-byte aligned
        streamcopy.widen(back, dst, stream=stream)
        assert np.array_equal(back.view(f"u{back.itemsize}"), src.view(f"u{src.itemsize}"))
    for value in ODD:
        for where in [(1, 3), (2, 1000)]:  # inside the vector loop, and in its tail
            odd = src.copy()
            odd[where] = value
            assert not streamcopy.narrow(dst, odd), (value, where)


@pytest.mark.parametrize("extension", [True, False])
def test_widen_streams_long_rows_at_any_alignment(monkeypatch, extension):
    if not extension:
        monkeypatch.setattr(streamcopy, "_widen", None)
    elif streamcopy._widen is None:
        pytest.skip("the C extension is not built here")
    samples = np.random.default_rng(2).integers(-32768, 32768, size=(2, 9001), dtype=np.int16)
    for at in range(5):  # 36 KB rows starting off a 16-byte boundary
        out = np.full((2, 9010), 7.0, dtype=np.float32)
        streamcopy.widen(out[:, at : at + 9001], samples, stream=True)
        assert np.array_equal(out[:, at : at + 9001], samples / np.float32(32768))
        assert (out[:, :at] == 7).all() and (out[:, at + 9001 :] == 7).all()


def test_narrow_refuses_other_dtypes():
    with pytest.raises(ValueError, match="int16"):
        streamcopy.narrow(np.zeros(4, np.float32), np.zeros(4, np.float32))
    if streamcopy._widen is not None:
        with pytest.raises(ValueError, match="int16"):
            streamcopy._widen(np.zeros(4, np.int16), np.zeros(4, np.int16), 0)


def _short_store(tmp_path: Path) -> tuple[str, dict[str, dict]]:
    """80 utterances of 0.2-2 s of int16 samples, packed (the short-items layout)."""
    rng = np.random.default_rng(4)
    data = {}
    for i in range(80):
        frames = int(rng.integers(20, 201))
        wav = rng.integers(-32768, 32768, size=(1, frames * 160), dtype=np.int16)
        act = (rng.random((2, frames)) > 0.5).astype(np.float32)
        data[f"spk{i % 5}/utt{i:03d}"] = {"wav": wav.astype(np.float32) / 32768, "act": act}
    h5 = write_h5(tmp_path / "short.h5", data)
    dst = tmp_path / "short.zarr"
    zstore.convert(h5, dst, rates=RATES, workers=1, progress=False, pack_seconds=60)
    return str(dst), data


@pytest.mark.parametrize("extension", [True, False])
def test_packed_short_items_of_int16_samples_read_back_bit_for_bit(
    tmp_path, monkeypatch, extension
):
    """Pack groups' shards are kept as int16 too: a WindowLoader's batches (one gather
    per field), single windows and whole items (``ds[i]``) read the stored float values,
    cold and warm, with the extension's widening gather and with numpy's."""
    if not extension:
        monkeypatch.setattr(streamcopy, "_gather", None)
        monkeypatch.setattr(streamcopy, "_widen", None)
    store, data = _short_store(tmp_path)
    cache = _cache(tmp_path)
    bits = np.uint32
    ds = zstore.WindowDataset(store, window_seconds=0.5, cache=cache, seed=2, fields=["wav"])
    loader = zstore.WindowLoader(ds, batch_size=16, shuffle=True)
    for _ in range(3):  # cold, then from the tier
        for batch in loader:
            for j, name in enumerate(batch["item"]):
                start, n = round(float(batch["start"][j]) * 16000), int(batch["length"][j])
                want = data[name]["wav"][:, start : start + n]
                got = batch["wav"][j].numpy()
                assert np.array_equal(got[:, :n].view(bits), want.view(bits)), name
                assert not got[:, n:].any()
        assert ds.settle(timeout=120)
    whole = zstore.WindowDataset(store, window_seconds=None, cache=cache)
    for i in range(len(whole)):
        x = whole[i]
        for key in ("wav", "act"):
            want = data[x["item"]][key]
            assert np.array_equal(np.asarray(x[key]).view(bits), want.view(bits)), x["item"]
    one = zstore.WindowDataset(store, window_seconds=0.1, cache=cache, seed=1, fields=["wav"])
    for i in range(len(one)):
        x = one[i]
        start, n = round(x["start"] * 16000), int(x["length"])
        want = data[x["item"]]["wav"][:, start : start + n]
        assert np.array_equal(np.asarray(x["wav"])[:, :n].view(bits), want.view(bits))
    assert whole.settle(timeout=120) and one.settle(timeout=120)
    stats = zstore.cache_stats(cache)["ram"]
    wav = sum(rec["wav"].nbytes for rec in data.values())
    assert stats["hits"] > 0
    # the packs as float32 take more than the items' wav (their last shards' tails);
    # as int16 samples, with the labels, ~0.72x of it here
    assert stats["fill_bytes"] < 0.8 * wav


def test_gather_widens_int16_samples_into_float_slots():
    if streamcopy._gather is None:
        pytest.skip("the C extension is not built here")
    samples = np.random.default_rng(3).integers(-32768, 32768, size=(2, 40000), dtype=np.int16)
    slots = [np.full((2, 30000), 5.0, dtype=np.float32) for _ in range(2)]
    parts = np.array([[0, 0, 10, 25000, 1], [1, 0, 0, 100, 0]], dtype=np.int64)
    pads = np.array([[1, 100]], dtype=np.int64)
    streamcopy.gather(slots, [samples], parts, pads, 1, stream=True)
    assert np.array_equal(slots[0][:, 1:25001], samples[:, 10:25010] / np.float32(32768))
    assert (slots[0][:, 0] == 5).all() and (slots[0][:, 25001:] == 5).all()
    assert np.array_equal(slots[1][:, :100], samples[:, :100] / np.float32(32768))
    assert not slots[1][:, 100:].any()
    with pytest.raises(ValueError, match="dtype"):  # float into int16: refused
        streamcopy.gather([samples], [slots[0]], np.zeros((1, 5), np.int64), pads[:0], 1)


@pytest.mark.parametrize("ram_format", ["decoded", "chunks"])
def test_an_append_of_true_float_audio_leaves_the_int16_shards_cached(tmp_path, ram_format):
    """An append of true-float items to a store of int16 samples widens what the
    manifest says ``wav`` holds, and with it the RAM form of every item's shards.  A job
    opened before it (int16 shards) and one opened after (float shards) on one node each
    keep their own form, under keys of their own: neither drops the other's as corrupt
    (they did, on every read of the other job, each rebuilding its own)."""
    store, data = _store(tmp_path, "int16", items=2)
    cache = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="256MB", ram_format=ram_format, ssd_dir=None
    )
    before = zstore.WindowDataset(
        store, window_seconds=7.0, seed=3, windows_per_item=4, cache=cache, fields=["wav", "act"]
    )
    check_epoch(before, data, 0)
    more = {"late": _recording(np.random.default_rng(9), 20.0, "float")}
    zstore.append(write_h5(tmp_path / "late.h5", more), store, workers=1, progress=False)
    after = zstore.WindowDataset(
        store, window_seconds=7.0, seed=3, windows_per_item=4, cache=cache, fields=["wav", "act"]
    )
    assert after.reader.manifest.arrays["wav"].values == "float"
    for epoch in (0, 0, 1):
        check_epoch(before, data, epoch)
        check_epoch(after, {**data, **more}, epoch)
    assert before.settle(timeout=120) and after.settle(timeout=120)
    stats = zstore.cache_stats(cache)["ram"]
    assert stats["corrupt"] == 0, stats
    assert stats["hits"] > 0, stats
