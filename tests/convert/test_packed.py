"""Packed short items (#26): corpora of short utterances stored as spans of shared
arrays, read through the one read path, converted, resumed, appended and verified."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import zarr
from conftest import PYTHON, kill_when, manifest_of, subprocess_env, write_h5

import zstore
from zstore.errors import StoreFormatError
from zstore.format import round_mantissa

RATES = {"wav": 16000, "act": 100}


def short_items(n: int, seed: int = 0, float_audio: bool = False, prefix: str = "spk"):
    """``n`` utterances of 0.1-1.0 s under speaker groups: ``wav`` (1, samples) at 16 kHz
    (int16 sample values, or true float), ``act`` (2, frames) at 100/s; attributes on
    the groups and on some datasets."""
    rng = np.random.default_rng(seed)
    items, attrs = {}, {}
    for i in range(n):
        frames = int(rng.integers(10, 101))
        samples = frames * 160
        if float_audio:
            wav = (rng.standard_normal((1, samples)) * 0.1).astype(np.float32)
        else:
            wav = (rng.integers(-32768, 32768, (1, samples)) / 32768).astype(np.float32)
        act = (rng.random((2, frames)) > 0.5).astype(np.float32)
        name = f"{prefix}{i % 7:02d}/utt{i:05d}"
        items[name] = {"wav": wav, "act": act}
        attrs[name] = {"speaker": f"s{i % 7}", "snr": float(rng.uniform(0, 30))}
    return items, attrs


def write_items(path: Path, items, attrs) -> str:
    write_h5(path, items, attrs)
    with h5py.File(path, "a") as f:
        first = next(iter(items))
        f[first]["wav"].attrs["gain"] = 0.5
    return str(path)


def read_whole(store: str, **kw) -> dict[str, dict[str, np.ndarray]]:
    ds = zstore.WindowDataset(store, window_seconds=None, **kw)
    out = {}
    for i in range(len(ds)):
        x = ds[i]
        out[x["item"]] = {k: np.asarray(x[k]) for k in ("wav", "act")}
    return out


def files_under(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in path.rglob("*")
        if p.is_file()
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """60 short items and 2 long ones (12 s), in one file."""
    tmp = tmp_path_factory.mktemp("packed")
    items, attrs = short_items(60, seed=1)
    rng = np.random.default_rng(9)
    for k in range(2):
        items[f"long/rec{k}"] = {
            "wav": (rng.integers(-32768, 32768, (1, 12 * 16000)) / 32768).astype(np.float32),
            "act": (rng.random((2, 1200)) > 0.5).astype(np.float32),
        }
    src = write_items(tmp / "short.h5", items, attrs)
    dst = str(tmp / "short.zarr")
    report = zstore.convert(src, dst, rates=RATES, workers=2, progress=False)
    return src, dst, items, attrs, report


def test_short_items_are_packed_and_read_back_bit_identical(corpus):
    src, dst, items, attrs, report = corpus
    assert report.packed == 60 and report.items == 62
    assert "60 packed" in str(report)
    got = read_whole(dst)
    assert set(got) == set(items)
    for name, arrays in items.items():
        for k, v in arrays.items():
            assert got[name][k].dtype == v.dtype
            np.testing.assert_array_equal(got[name][k], v, err_msg=f"{name}/{k}")
    # A few objects for 60 items: two shards, a record and metadata per pack group.
    packed = [p for p in Path(dst, "zstore_packed").rglob("*") if p.is_file()]
    assert len(packed) <= 10
    # Long items keep their own groups, for zarr-python too.
    root = zarr.open_group(dst, mode="r")
    np.testing.assert_array_equal(root["long/rec0/wav"][...], items["long/rec0"]["wav"])
    assert "spk00" not in root  # a packed item has no group of its own


def test_packed_items_keep_their_attributes(corpus):
    _, dst, items, attrs, _ = corpus
    name = "spk03/utt00010"
    chosen = zstore.WindowDataset(
        dst, window_seconds=None, items=lambda n, a: a.get("speaker") == "s3"
    )
    names = sorted(chosen.locate(i)[0] for i in range(len(chosen)))
    assert name in names
    assert names == sorted(n for n in items if attrs.get(n, {}).get("speaker") == "s3")


def test_windows_of_packed_items_never_hold_a_neighbours_samples(corpus):
    _, dst, items, _, _ = corpus
    ds = zstore.WindowDataset(dst, window_seconds=0.5, short="pad", seed=3)
    seen_short = 0
    for i in range(len(ds)):
        x = ds[i]
        name, frame = x["item"], round(float(x["start"]) * 100)
        src = items[name]
        for key, per_frame in (("wav", 160), ("act", 1)):
            lo = frame * per_frame
            want = src[key][:, lo : lo + np.asarray(x[key]).shape[1]]
            got = np.asarray(x[key])
            np.testing.assert_array_equal(got[:, : want.shape[1]], want)
            assert not got[:, want.shape[1] :].any(), f"{name}/{key}: samples past its end"
            seen_short += want.shape[1] < got.shape[1]
    assert seen_short  # some windows ran past an item's end


def test_window_loader_batches_of_packed_items(corpus, cache):
    _, dst, items, _, _ = corpus
    ds = zstore.WindowDataset(dst, window_seconds=0.1, cache=cache, seed=5)
    loader = zstore.WindowLoader(ds, batch_size=8, shuffle=True)
    n = 0
    for _ in range(2):  # the second epoch from the warm RAM tier
        for batch in loader:
            for j, name in enumerate(batch["item"]):
                start = round(float(batch["start"][j]) * 16000)
                want = items[name]["wav"][:, start : start + 1600]
                np.testing.assert_array_equal(batch["wav"][j].numpy(), want)
                n += 1
    assert n == 2 * len(ds)


def test_collate_pad_batches_whole_packed_items(corpus):
    _, dst, items, _, _ = corpus
    ds = zstore.WindowDataset(dst, window_seconds=None)
    loader = torch.utils.data.DataLoader(ds, batch_size=5, collate_fn=zstore.collate_pad)
    batch = next(iter(loader))
    for j, name in enumerate(batch["item"]):
        n = int(batch["wav_length"][j])
        np.testing.assert_array_equal(batch["wav"][j, :, :n].numpy(), items[name]["wav"])
        assert not batch["wav"][j, :, n:].any()


def test_packed_arrays_are_plain_zarr_with_their_spans_in_the_records(corpus):
    """What the README says: any Zarr v3 reader slices an item out of a pack group's
    array with the offsets and lengths of its batch record."""
    _, dst, items, _, _ = corpus
    root = zarr.open_group(dst, mode="r")
    found = 0
    for record_path in sorted(Path(dst, "zstore_packed").glob("*/items.*.json")):
        record = json.loads(record_path.read_text())
        group = record_path.parent.name
        wav = root[f"zstore_packed/{group}/wav"]
        for k, name in enumerate(record["items"]):
            o, n = record["offsets"]["wav"][k], record["lengths"]["wav"][k]
            np.testing.assert_array_equal(wav[:, o : o + n], items[name]["wav"])
            found += 1
    assert found == 60
    ts = pytest.importorskip("tensorstore")
    arr = ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{dst}/zstore_packed/0/act"}}
    ).result()
    record = json.loads(Path(dst, "zstore_packed/0/items.0.json").read_text())
    o, n = record["offsets"]["act"][0], record["lengths"]["act"][0]
    np.testing.assert_array_equal(
        arr[:, o : o + n].read().result(), items[record["items"][0]]["act"]
    )


def test_true_float_audio_is_packed_exactly_and_with_a_stated_precision(tmp_path):
    items, attrs = short_items(30, seed=4, float_audio=True)
    src = write_items(tmp_path / "f.h5", items, attrs)
    exact = str(tmp_path / "exact.zarr")
    zstore.convert(src, exact, rates=RATES, workers=1, progress=False, verify=True)
    got = read_whole(exact)
    for name, arrays in items.items():
        np.testing.assert_array_equal(got[name]["wav"], arrays["wav"])
    rounded = str(tmp_path / "rounded.zarr")
    report = zstore.convert(
        src, rounded, rates=RATES, workers=1, progress=False, precision={"wav": 12}, verify=True
    )
    assert report.packed == 30 and report.verified
    got = read_whole(rounded)
    for name, arrays in items.items():
        want = round_mantissa(arrays["wav"], 12)
        np.testing.assert_array_equal(got[name]["wav"], want)
    meta = json.loads(Path(rounded, "zstore_packed/0/wav/zarr.json").read_text())
    assert meta["attributes"]["zstore_precision"]["mantissa_bits"] == 12


def test_pack_seconds_zero_keeps_every_item_in_its_own_group(tmp_path):
    items, attrs = short_items(5, seed=2)
    src = write_items(tmp_path / "s.h5", items, attrs)
    dst = tmp_path / "own.zarr"
    report = zstore.convert(src, dst, rates=RATES, workers=1, progress=False, pack_seconds=0)
    assert report.packed == 0 and not (dst / "zstore_packed").exists()
    assert (
        zarr.open_group(dst, mode="r")["spk00/utt00000/wav"].shape
        == items["spk00/utt00000"]["wav"].shape
    )
    with pytest.raises(zstore.SourceError, match="--pack-seconds"):
        zstore.convert(src, tmp_path / "x.zarr", rates=RATES, pack_seconds=-1, progress=False)


def test_verify_finds_a_damaged_packed_shard(tmp_path):
    items, attrs = short_items(20, seed=5)
    src = write_items(tmp_path / "s.h5", items, attrs)
    dst = tmp_path / "v.zarr"
    zstore.convert(src, dst, rates=RATES, workers=1, progress=False)
    shard = next(Path(dst, "zstore_packed/0/wav/c").rglob("*"))
    while shard.is_dir():
        shard = next(shard.iterdir())
    raw = bytearray(shard.read_bytes())
    raw[40] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(StoreFormatError, match=r"zstore_packed/0 batch 0 .*differ"):
        zstore.convert(src, dst, rates=RATES, workers=1, progress=False, verify=True)


@pytest.mark.parametrize("pack_seconds", [10.0, 0.0], ids=["packed", "one group per item"])
def test_verify_compares_values_where_the_bytes_differ(tmp_path, monkeypatch, pack_seconds):
    """A store written at another compression level (zstd 3 before this release) or by
    another Blosc build holds other bytes for the same values: it verifies.  A value
    changed in the store, in a valid object, still fails, naming the item."""
    from zstore.format import objects

    items, attrs = short_items(12, seed=8)
    src = write_items(tmp_path / "s.h5", items, attrs)
    kw = dict(rates=RATES, codec="zstd", workers=1, progress=False, pack_seconds=pack_seconds)
    now = tmp_path / "now.zarr"
    zstore.convert(src, now, **kw)
    old = tmp_path / "old.zarr"
    monkeypatch.setitem(objects.CODEC_CONFIG, "zstd", {**objects.CODEC_CONFIG["zstd"], "clevel": 9})
    zstore.convert(src, old, **kw)
    monkeypatch.undo()
    wav = "zstore_packed/0/wav" if pack_seconds else "spk00/utt00000/wav"
    shard = next(p for p in sorted(Path(old, wav, "c").rglob("*")) if p.is_file())
    assert shard.read_bytes() != (now / shard.relative_to(old)).read_bytes()
    assert zstore.convert(src, old, verify=True, **kw).verified
    array = zarr.open_group(old, mode="r+")[wav]
    array[0, 3] = np.float32(0.123)  # the first item's fourth sample, a valid object
    with pytest.raises(StoreFormatError, match="spk00/utt00000/wav"):
        zstore.convert(src, old, verify=True, **kw)


def test_append_adds_shards_and_rewrites_none(tmp_path, cache):
    first, attrs1 = short_items(40, seed=6, prefix="a")
    second, attrs2 = short_items(25, seed=7, prefix="b")
    src1 = write_items(tmp_path / "one.h5", first, attrs1)
    src2 = write_items(tmp_path / "two.h5", second, attrs2)
    dst = tmp_path / "app.zarr"
    zstore.convert(src1, dst, rates=RATES, workers=1, progress=False)
    store_id = json.loads((dst / "zarr.json").read_text())["attributes"]["zstore"]["store_id"]
    shards_before = {
        k: v for k, v in files_under(dst / "zstore_packed").items() if "/c/" in k or "items." in k
    }
    # A reader opened before the append, warm in the RAM tier.
    before = zstore.WindowDataset(dst, window_seconds=None, cache=cache)
    warm = {before[i]["item"]: np.asarray(before[i]["wav"]) for i in range(len(before))}
    report = zstore.append(src2, dst, workers=2, progress=False, verify=True)
    assert report.packed == 25 and report.converted == 25
    after = files_under(dst / "zstore_packed")
    assert {k: after[k] for k in shards_before} == shards_before  # not one byte rewritten
    assert len([k for k in after if "/c/" in k]) > len([k for k in shards_before if "/c/" in k])
    assert (
        json.loads((dst / "zarr.json").read_text())["attributes"]["zstore"]["store_id"] == store_id
    )
    got = read_whole(str(dst), cache=cache)
    for name, arrays in {**first, **second}.items():
        np.testing.assert_array_equal(got[name]["wav"], arrays["wav"])
        np.testing.assert_array_equal(got[name]["act"], arrays["act"])
    for name, wav in warm.items():  # the old reader's view still reads its items
        np.testing.assert_array_equal(wav, first[name]["wav"])
    again = zstore.append(src2, dst, workers=1, progress=False)
    assert again.converted == 0 and files_under(dst / "zstore_packed") == after
    with pytest.raises(zstore.SourceError, match="--pack-seconds 2 was given.* at most 10 s"):
        zstore.append(src2, dst, progress=False, pack_seconds=2)


def test_resume_after_sigkill_rewrites_no_finished_batch(tmp_path):
    items, attrs = short_items(3000, seed=8)
    src = write_items(tmp_path / "many.h5", items, attrs)
    dst = tmp_path / "k.zarr"
    cmd = [PYTHON, "-m", "zstore.cli", "convert", src, str(dst), "--rate", "wav=16000"]
    cmd += ["--rate", "act=100", "--workers", "1", "--no-progress"]
    proc = subprocess.Popen(
        cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    records = lambda: sorted(dst.glob("zstore_packed/*/items.*.json"))  # noqa: E731
    kill_when(proc, lambda: bool(records()))
    assert proc.returncode == -signal.SIGKILL, "the converter finished before it was killed"
    done = {p.name: p.stat().st_mtime_ns for p in records()}
    report = zstore.convert(src, dst, rates=RATES, workers=1, progress=False, verify=True)
    assert report.items == 3000 and 0 < report.already_done < 3000
    assert {p.name: p.stat().st_mtime_ns for p in records() if p.name in done} == done
    # the manifest's byte count covers the batches written before the kill too
    packed_bytes = sum(p.stat().st_size for p in (dst / "zstore_packed").rglob("*") if p.is_file())
    assert manifest_of(dst).extra["store_bytes"] >= packed_bytes
    got = read_whole(str(dst))
    for name in list(items)[::97]:
        np.testing.assert_array_equal(got[name]["wav"], items[name]["wav"])


def test_info_shows_packed_items_and_objects_per_item(corpus, capsys):
    _, dst, _, _, _ = corpus
    from zstore.cli import main

    main(["info", dst])
    out = capsys.readouterr().out
    assert "packed: 60 of 62 items" in out
    assert "objects per item" in out
    info = zstore.store_info(dst)
    files = [p for p in Path(dst).rglob("*") if p.is_file() and p.name != "zstore.lock"]
    assert info["objects"] == len(files) and info["packed_items"] == 60
    wav = info["arrays"]["wav"]  # the first item, long/rec0, has its own group
    assert wav["shard_length"] == 12 * 16000 and wav["shape_of_first_item"] == [1, 12 * 16000]


def test_info_of_a_store_of_packed_items_shows_the_packed_chunking(tmp_path):
    items, attrs = short_items(5, seed=13)
    dst = tmp_path / "p.zarr"
    zstore.convert(write_items(tmp_path / "s.h5", items, attrs), dst, rates=RATES, progress=False)
    wav = zstore.store_info(str(dst))["arrays"]["wav"]
    assert wav["chunk"] == [1, 16000] and wav["shard_length"] == 64 * 16000
    assert wav["shape_of_first_item"] == list(manifest_of(dst).shapes["wav"][0])


def test_packed_store_on_s3(tmp_path, s3):
    import s3fs

    options, _ = s3
    items, attrs = short_items(200, seed=10)
    for i, arrays in enumerate(items.values()):  # a class label in every group
        arrays["label"] = np.int64(i % 12)
    src = write_items(tmp_path / "s.h5", items, attrs)
    url = "s3://zstore-test/short.zarr"
    report = zstore.convert(
        src, url, rates=RATES, workers=2, progress=False, storage_options=options
    )
    assert report.packed == 200
    objects = s3fs.S3FileSystem(**options).find("zstore-test/short.zarr")
    assert len(objects) / 200 <= 0.1  # metadata and the item table included
    got = read_whole(url, storage_options=options)
    for name in list(items)[::11]:
        np.testing.assert_array_equal(got[name]["wav"], items[name]["wav"])
    ds = zstore.WindowDataset(
        url, window_seconds=0.05, fields=["wav", "label"], storage_options=options
    )
    for i in range(0, len(ds), 13):
        x = ds[i]
        assert int(x["label"]) == items[x["item"]]["label"]


def test_packed_items_attributes_keep_nan_and_references(tmp_path):
    import math

    items, _ = short_items(4, seed=11)
    src = tmp_path / "odd.h5"
    write_h5(src, items)
    with h5py.File(src, "a") as f:
        first = next(iter(items))
        f[first].attrs["snr"] = np.nan
        f[first].attrs["source"] = f[first]["wav"].ref
    dst = tmp_path / "odd.zarr"
    zstore.convert(str(src), dst, rates=RATES, workers=1, progress=False)
    for record in dst.glob("zstore_packed/*/items.*.json"):
        json.loads(record.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    seen = {}
    ds = zstore.WindowDataset(
        dst, window_seconds=None, items=lambda n, a: seen.setdefault(n, a) is not None
    )
    assert len(ds) == 4
    assert math.isnan(seen[first]["snr"]) and seen[first]["source"] == f"/{first}/wav"


@pytest.mark.parametrize("pack_seconds", [0.0, 10.0], ids=["own groups", "packed"])
def test_items_attributes_are_the_sources_without_zstores_marks(tmp_path, pack_seconds):
    items, attrs = short_items(4, seed=13)
    src = write_items(tmp_path / "a.h5", items, attrs)
    dst = tmp_path / "a.zarr"
    zstore.convert(src, dst, rates=RATES, workers=1, progress=False, pack_seconds=pack_seconds)
    seen = {}
    zstore.WindowDataset(dst, window_seconds=None, items=lambda n, a: seen.setdefault(n, a) or True)
    with h5py.File(src) as f:
        for name, got in seen.items():
            want = {
                k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in f[name].attrs.items()
            }
            assert got == want, name  # no "zstore_complete" beside the item's own


def test_verify_of_a_stated_precision_checks_packed_values_within_the_rounding(tmp_path):
    items, attrs = short_items(12, seed=12, float_audio=True)
    src = write_items(tmp_path / "f.h5", items, attrs)
    dst = tmp_path / "p.zarr"
    zstore.convert(src, dst, rates=RATES, workers=1, progress=False, precision={"wav": 16})
    record = json.loads(Path(dst, "zstore_packed/0/items.0.json").read_text())
    name = record["items"][3]
    o, n = record["offsets"]["wav"][3], record["lengths"]["wav"][3]
    wav = zarr.open_array(dst / "zstore_packed/0/wav", mode="r+")

    def verify() -> None:
        zstore.convert(
            src, dst, rates=RATES, workers=1, progress=False, precision={"wav": 16}, verify=True
        )

    wav[:, o : o + n] = round_mantissa(items[name]["wav"], 20)  # more precise than stated
    verify()
    wav[:, o : o + n] = round_mantissa(items[name]["wav"], 8)  # coarser: named
    with pytest.raises(StoreFormatError, match=rf"{name}/wav: \d+ value\(s\) differ .* 16"):
        verify()


def test_labels_that_are_zero_in_some_items_are_whole_numbers(corpus, tmp_path):
    items = {
        "a/u0": {"wav": np.zeros((1, 1600), np.float32), "act": np.zeros((2, 10), np.float32)},
        "a/u1": {
            "wav": np.full((1, 1600), 3 / 32768, np.float32),
            "act": np.ones((2, 10), np.float32),
        },
    }
    src = write_h5(tmp_path / "z.h5", items)
    report = zstore.convert(src, tmp_path / "z.zarr", rates=RATES, workers=1, progress=False)
    assert report.arrays["act"].values == "whole" and report.arrays["wav"].values == "int16"


def test_packed_items_of_every_hdf5_storage_read_bit_identical(tmp_path):
    """Contiguous datasets are copied straight out of the file; chunked, compressed,
    big-endian and attribute-carrying ones too, each equal to what h5py reads."""
    rng = np.random.default_rng(14)
    src = tmp_path / "mixed.h5"
    with h5py.File(src, "w") as f:
        for i in range(12):
            g = f.create_group(f"u{i:02d}")
            wav = (rng.integers(-32768, 32768, (1, 1600 + 160 * i)) / 32768).astype(np.float32)
            act = (rng.random((2, 10 + i)) > 0.5).astype(np.float32)
            if i % 3 == 1:
                g.create_dataset("wav", data=wav, chunks=(1, 800), compression="gzip")
            elif i % 3 == 2:
                g.create_dataset("wav", data=wav, chunks=(1, 320))
            else:
                g.create_dataset("wav", data=wav)
            g.create_dataset("act", data=act.astype(">f4"), dtype=">f4")  # big-endian
            if i % 4 == 0:
                g["act"].attrs["unit"] = "frame"
                g.attrs["speaker"] = f"s{i}"
    dst = tmp_path / "m.zarr"
    report = zstore.convert(str(src), dst, rates=RATES, workers=2, progress=False, verify=True)
    assert report.packed == 12
    got = read_whole(str(dst))
    seen = {}
    zstore.WindowDataset(dst, window_seconds=None, items=lambda n, a: seen.setdefault(n, a) or True)
    with h5py.File(src, "r") as f:
        for name in f:
            for k in ("wav", "act"):
                want = f[name][k][()]
                assert got[name][k].tobytes() == want.astype(want.dtype.newbyteorder("=")).tobytes()
            assert seen[name] == dict(f[name].attrs)
    records = [json.loads(p.read_text()) for p in dst.glob("zstore_packed/*/items.*.json")]
    arrays = {n: e["arrays"] for r in records for n, e in r["entries"].items() if "arrays" in e}
    assert arrays == {f"u{i:02d}": {"act": {"unit": "frame"}} for i in (0, 4, 8)}


def test_low_level_attributes_equal_h5pys(tmp_path):
    """The packed path reads numeric attributes through h5py's low-level API; any
    other kind through h5py's attribute manager: the same JSON either way."""
    from zstore.format import hdf5_attrs, hdf5_attrs_of

    path = tmp_path / "a.h5"
    with h5py.File(path, "w") as f:
        numeric = f.create_group("numeric")
        numeric.attrs.update(
            {"b": 3, "a": np.float32(1.5), "nan": np.nan, "arr": np.arange(3), "bool": True}
        )
        numeric.attrs["inf"] = np.array([1.0, np.inf, -np.inf])
        numeric.attrs["half"] = np.float16(2.5)
        mixed = f.create_group("mixed")
        mixed.attrs["text"] = "spk01"
        mixed.attrs["n"] = 2
        mixed.attrs["ref"] = numeric.ref
        mixed.attrs["empty"] = h5py.Empty("f4")
        f.create_group("none")
    with h5py.File(path, "r") as f:
        for name in ("numeric", "mixed", "none"):
            gid = h5py.h5g.open(f.id, name.encode())
            group = f[name]
            assert hdf5_attrs_of(gid, lambda: group) == hdf5_attrs(group), name  # noqa: B023
        assert hdf5_attrs(f["numeric"])["zstore_nonfinite"] == ["inf", "nan"]


def test_a_source_rewritten_after_the_scan_is_read_through_hdf5(tmp_path):
    """Datasets are copied straight out of the file at the offsets the scan found only
    while the file is the one scanned; a rewritten one (other offsets) is read by HDF5."""
    from zstore.convert._read import read_items
    from zstore.convert._scan import scan

    src = tmp_path / "s.h5"
    old, _ = short_items(3, seed=15)
    write_h5(src, old)
    items, _ = scan(str(src))
    assert all(it.offsets for it in items)
    new, _ = short_items(3, seed=16)
    new = {
        name: {k: np.resize(v, old[name][k].shape) for k, v in arrays.items()}
        for name, arrays in new.items()
    }
    with h5py.File(src, "w") as f:
        f.create_dataset("padding", data=np.zeros(100_000, np.float32))  # moves every offset
        for name, arrays in new.items():
            for k, v in arrays.items():
                f.create_dataset(f"{name}/{k}", data=v)
    for item, arrays, _ in read_items(items):
        for k, v in arrays.items():
            np.testing.assert_array_equal(v, new[item.name][k])


def test_import_zstore_leaves_torch_to_the_training_names():
    """A conversion's workers import zstore: without torch they start in ~0.4 s, not
    ~1.6 s (on 2 cores their imports ran beside the scan of the source)."""
    code = (
        "import sys, zstore\n"
        "assert 'torch' not in sys.modules, 'import zstore imported torch'\n"
        "zstore.convert, zstore.store_info\n"
        "assert 'torch' not in sys.modules, 'the converter imported torch'\n"
        "assert zstore.WindowDataset.__name__ == 'WindowDataset' and 'torch' in sys.modules\n"
    )
    proc = subprocess.run(
        [PYTHON, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr


def _served_by(monkeypatch, name: str) -> list[bool]:
    """Whether each call of ``zstore.read._packed_batch.<name>``, as the reader makes
    it, served its windows (returned something)."""
    from zstore.read import _packed_batch
    from zstore.read import reader as reader_module

    real, served = getattr(_packed_batch, name), []

    def spy(*args):
        found = real(*args)
        served.append(found is not None)
        return found

    monkeypatch.setattr(reader_module, name, spy)
    return served


def _small_packed(tmp_path, n: int, seed: int):
    """``n`` short items packed with 0.25 s chunks (so some end in the next shard)."""
    items, attrs = short_items(n, seed=seed)
    src = write_items(tmp_path / "s.h5", items, attrs)
    dst = str(tmp_path / "p.zarr")
    zstore.convert(src, dst, rates=RATES, workers=1, progress=False, chunk_seconds=0.25)
    return items, dst


@pytest.mark.parametrize(
    ("ram_format", "split"), [("decoded", False), ("encoded", False), ("decoded", True)]
)
def test_window_loader_reads_packed_windows_whole_and_padded(
    tmp_path, monkeypatch, ram_format, split
):
    """Batches of 1 s windows of 0.1-1 s packed items (padded with zeros past their
    end, some items beginning in one shard and ending in the next): bit-identical to
    the source, cold and once every shard is mapped in this process, when the decoded
    shards serve each batch's windows as one slice each (``_packed_batch``); ``split``:
    each field's copies in calls of 3 windows (as batches of long windows are)."""
    from zstore.read import _packed_batch

    if split:
        monkeypatch.setattr(_packed_batch, "SPLIT_BYTES", 0)
        monkeypatch.setattr(_packed_batch, "SPLIT_WINDOWS", 3)
    items, dst = _small_packed(tmp_path, 300, seed=21)
    served = _served_by(monkeypatch, "packed_batch")
    cache = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="64MB", ram_format=ram_format)
    ds = zstore.WindowDataset(dst, window_seconds=1.0, cache=cache, short="pad", seed=2)
    manifest = ds.reader.open().manifest
    layout = ds.reader.pack_layout(manifest.packs[0], "wav")
    ends = [  # items that begin in one shard of the pack's wav and end in the next
        p
        for p in range(len(manifest.items))
        if (o := manifest.placement.offsets["wav"][p]) // layout.shard
        != (o + manifest.shapes["wav"][p][1] - 1) // layout.shard
    ]
    assert ends, "no item crosses a shard boundary: the test would not cover it"
    loader = zstore.WindowLoader(ds, batch_size=16, shuffle=True)
    # Epoch 2 is the warm one: a shard whose fill found its lock stripe held by another
    # shard's fill behind the reads is read from its chunks and filled on its next read,
    # which may be in epoch 1 (the locks are striped by a hash of the store's keys).
    for epoch in range(3):
        served.clear()
        loader.set_epoch(epoch)
        seen = 0
        for batch in loader:
            for j, name in enumerate(batch["item"]):
                for key, per_frame in (("wav", 160), ("act", 1)):
                    want = items[name][key]
                    got = batch[key][j].numpy()
                    n = want.shape[1]
                    np.testing.assert_array_equal(got[:, :n], want, err_msg=f"{name}/{key}")
                    assert not got[:, n:].any(), f"{name}/{key}: samples past its end"
                    assert got.shape[1] == 100 * per_frame
                seen += 1
        assert seen == len(ds) == 300
        ds.settle(timeout=120)
    assert all(served) is (ram_format == "decoded")  # warm: every batch from the maps


@pytest.mark.parametrize("ram_format", ["decoded", "encoded"])
def test_whole_packed_items_and_their_windows_read_alone(tmp_path, monkeypatch, ram_format):
    """``ds[i]`` of packed items, whole and as padded 1 s windows: bit-identical to the
    source, cold and warm (after a second pass); warm, every item is copied out of its
    shards (``packed_read``, an item that ends in the next shard out of both), counted as
    one RAM hit per shard per field as before."""
    items, dst = _small_packed(tmp_path, 200, seed=22)
    served = _served_by(monkeypatch, "packed_read")
    cache = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="64MB", ram_format=ram_format)
    for window in (None, 1.0):
        ds = zstore.WindowDataset(dst, window_seconds=window, cache=cache, short="pad", seed=4)
        m = ds.reader.open().manifest
        touched = []  # per item and field, the shards its whole span lies in
        for p in range(len(m.items)):
            for key in ("wav", "act"):
                layout = ds.reader.pack_layout(m.packs[int(m.placement.group[p])], key)
                o = int(m.placement.offsets[key][p])
                n = int(m.shapes[key][p][layout.time_axis])
                touched.append((o + n - 1) // layout.shard - o // layout.shard + 1)
        assert max(touched) == 2, "no item ends in the next shard: the test would not cover it"
        # A shard whose fill found its lock stripe held by another fill behind the
        # reads is filled on its next read: a second pass puts in what the first left
        # out, so the warm pass is served entirely from the tier.
        for warm in (False, False, True):
            served.clear()
            hits = zstore.cache_stats(cache)["ram"]["hits"]
            for i in range(len(ds)):
                x = ds[i]
                for key in ("wav", "act"):
                    want, got = items[x["item"]][key], x[key].numpy()
                    np.testing.assert_array_equal(got[:, : want.shape[1]], want)
                    assert not got[:, want.shape[1] :].any()
                    if window is None:
                        assert got.shape == want.shape
            ds.settle(timeout=120)
            if warm:  # a hit per shard of each field
                assert zstore.cache_stats(cache)["ram"]["hits"] - hits == sum(touched)
        if ram_format == "decoded":
            assert all(served)
        else:
            assert not any(served)


def test_attributes_of_a_committed_type_then_of_another_file(tmp_path):
    """An attribute stored with a committed (named) datatype, then the attributes of
    another file: each read on its own (a type kept from the first file, closed since,
    once made the second read fail with 'Not a datatype')."""
    from zstore.format import hdf5_attrs_of

    first, second = tmp_path / "a.h5", tmp_path / "b.h5"
    with h5py.File(first, "w") as f:
        f["t"] = np.dtype("f8")
        f.create_group("g").attrs.create("x", 1.5, dtype=f["t"])
    with h5py.File(second, "w") as f:
        f.create_group("g").attrs["y"] = 2.0
    for path, want in ((first, {"x": 1.5}), (second, {"y": 2.0})):
        with h5py.File(path, "r") as f:
            assert hdf5_attrs_of(f["g"].id, lambda: f["g"]) == want  # noqa: B023


def labelled_items(n: int, seed: int = 0, prefix: str = "kw"):
    """Keyword-spotting utterances as corpora keep them: ``wav`` of 0.1-1.0 s, a scalar
    class ``label`` and a 16-value float ``emb`` in each group (no ``emb`` in every
    fifth), and one group with an embedding too large to pack (8 KB)."""
    rng = np.random.default_rng(seed)
    items = {}
    for i in range(n):
        samples = int(rng.integers(10, 101)) * 160
        arrays = {
            "wav": (rng.integers(-32768, 32768, (1, samples)) / 32768).astype(np.float32),
            "label": np.int64(i % 12),
        }
        if i % 5:
            arrays["emb"] = rng.standard_normal(2048 if i == 3 else 16).astype(np.float32)
        items[f"{prefix}{i:04d}"] = arrays
    return items


def test_short_items_with_labels_and_embeddings_are_packed(tmp_path, cache):
    items = labelled_items(60)
    src = write_h5(tmp_path / "kws.h5", items)
    dst = tmp_path / "kws.zarr"
    report = zstore.convert(src, dst, rates={"wav": 16000}, progress=False, verify=True)
    assert report.packed == 59  # all but the one with the 8 KB embedding
    manifest = manifest_of(dst)
    assert manifest.placement.where(manifest.position("kw0003"), "wav") is None
    objects = sum(1 for p in dst.rglob("*") if p.is_file())
    assert objects < 30  # ~5 an item in groups of their own
    fields = ["wav", "label", "emb"]
    for tiers in (None, cache, cache):  # the second run finds the records in the tiers
        for seconds in (None, 0.05):
            ds = zstore.WindowDataset(
                dst, window_seconds=seconds, fields=fields, missing="skip", cache=tiers
            )
            assert len(ds) == 48
            for i in range(len(ds)):
                x = ds[i]
                want = items[x["item"]]
                assert x["label"].shape == () and int(x["label"]) == want["label"]
                np.testing.assert_array_equal(x["emb"].numpy(), want["emb"])
                start = round(x["start"] * 16000)
                np.testing.assert_array_equal(
                    x["wav"].numpy(), want["wav"][:, start : start + x["wav"].shape[1]]
                )
        ds = zstore.WindowDataset(  # batches of one embedding size: not kw0003's
            dst,
            window_seconds=0.05,
            fields=fields,
            missing="skip",
            cache=tiers,
            items=[name for name in items if name != "kw0003"],
        )
        for epoch in (0, 1):  # the second epoch from the mapped shards, where tiers
            ds.set_epoch(epoch)
            seen = 0
            for b in zstore.WindowLoader(ds, batch_size=8, shuffle=True):
                for j, item in enumerate(b["item"]):
                    assert int(b["label"][j]) == items[item]["label"]
                    np.testing.assert_array_equal(b["emb"][j].numpy(), items[item]["emb"])
                seen += len(b["item"])
            assert seen == len(ds)
    labels = zstore.WindowDataset(dst, window_seconds=None, fields=["label"])
    assert sorted(int(labels[i]["label"]) for i in range(len(labels))) == sorted(
        int(a["label"]) for a in items.values()
    )


def test_packed_arrays_stored_whole_are_json_in_the_records(tmp_path):
    """What the README says to read them without zstore."""
    import base64

    items = labelled_items(30, seed=1)
    src = write_h5(tmp_path / "kws.h5", items)
    dst = tmp_path / "kws.zarr"
    zstore.convert(src, dst, rates={"wav": 16000}, progress=False)
    found = {}
    for path in sorted((dst / "zstore_packed/0").glob("items.*.json")):
        record = json.loads(path.read_text())
        for name, entry in record["arrays"].items():
            data = base64.b64decode(entry["data"])
            at = 0
            for k, shape in zip(entry["items"], entry["shapes"]):
                value = np.frombuffer(
                    data, dtype=entry["dtype"], count=int(np.prod(shape)), offset=at
                ).reshape(shape)
                at += value.nbytes
                found[(record["items"][k], name)] = value
    want = {
        (item, name): np.asarray(v)
        for item, arrays in items.items()
        if item != "kw0003"
        for name, v in arrays.items()
        if name != "wav"
    }
    assert found.keys() == want.keys()
    for key, value in want.items():
        assert found[key].shape == value.shape
        np.testing.assert_array_equal(found[key], value)


def test_verify_finds_a_damaged_array_in_a_record(tmp_path):
    items = labelled_items(20, seed=2)
    src = write_h5(tmp_path / "kws.h5", items)
    dst = tmp_path / "kws.zarr"
    zstore.convert(src, dst, rates={"wav": 16000}, progress=False)
    path = dst / "zstore_packed/0/items.0.json"
    record = json.loads(path.read_text())
    entry = record["arrays"]["label"]
    entry["data"] = entry["data"][:-4] + ("AAAA" if entry["data"][-4:] != "AAAA" else "AQAA")
    path.write_text(json.dumps(record))
    with pytest.raises(StoreFormatError, match=r"batch 0 .*'label' \(stored whole\) differs"):
        zstore.convert(src, dst, rates={"wav": 16000}, progress=False, verify=True)


def test_an_append_packs_labelled_items_after_the_others(tmp_path, cache):
    first, second = labelled_items(30, seed=3, prefix="a"), labelled_items(20, seed=4, prefix="b")
    dst = tmp_path / "kws.zarr"
    zstore.convert(write_h5(tmp_path / "a.h5", first), dst, rates={"wav": 16000}, progress=False)
    report = zstore.append(write_h5(tmp_path / "b.h5", second), dst, progress=False, verify=True)
    assert report.packed == 19
    ds = zstore.WindowDataset(
        dst, window_seconds=None, fields=["wav", "label", "emb"], missing="skip", cache=cache
    )
    assert len(ds) == 40
    both = {**first, **second}
    for i in range(len(ds)):
        x = ds[i]
        for name in ("wav", "label", "emb"):
            np.testing.assert_array_equal(x[name].numpy(), both[x["item"]][name])


@pytest.mark.parametrize("kept", [None, 1], ids=["all records kept", "one record kept"])
def test_each_batch_record_is_read_once_per_process(tmp_path, monkeypatch, kept):
    # a record parsed again for each window read its labels 35x slower than its audio
    import zstore.read._records as records

    items = {
        f"u{i:02d}": {"wav": np.zeros((1, 16000 * 8), np.float32), "label": np.int64(i)}
        for i in range(40)
    }  # 320 s: two batches, two records
    src = write_h5(tmp_path / "a.h5", items)
    zstore.convert(src, tmp_path / "a.zarr", rates={"wav": 16000}, progress=False)
    loads: list[str] = []
    load = records.BatchRecords._load
    monkeypatch.setattr(
        records.BatchRecords, "_load", lambda self, key: loads.append(key) or load(self, key)
    )
    if kept:
        monkeypatch.setattr(records, "MAX_RECORDS", kept)
    ds = zstore.WindowDataset(tmp_path / "a.zarr", window_seconds=1.0, fields=["wav", "label"])
    for _ in range(2):
        for i in range(len(ds)):
            x = ds[i]
            assert int(x["label"]) == int(x["item"][1:])
    assert len(set(loads)) == 2
    assert len(loads) == (2 if kept is None else 4)  # in item order: each evicted once


def test_a_corpus_all_packed_shows_one_progress_bar(tmp_path, capsys):
    """Every item packed: the bar of the packed items, and no empty bar of unpacked ones."""
    items, attrs = short_items(5, seed=3)
    src = write_items(tmp_path / "all_short.h5", items, attrs)
    zstore.convert(src, str(tmp_path / "s.zarr"), rates=RATES, workers=1, progress=True)
    err = capsys.readouterr().err
    assert "convert (packed)" in err and "5/5" in err
    assert "convert:" not in err, err
