"""Never wrong data: lost objects are errors on every read path, windows never reach past
an array's end, and bad input is one clear error (exit code 2 from the CLI)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from conftest import (
    PYTHON,
    RATES,
    assert_one_line_error,
    cli,
    edit_header,
    kill_when,
    subprocess_env,
    write_h5,
)

import zstore

MODES = {
    "no-cache": False,
    "decoded-ram": dict(ram_format="decoded"),
    "encoded-ram": dict(ram_format="encoded"),
    "ssd-only": dict(ram_bytes=0),
    "shard-fetch": dict(fetch="shard"),
}


def cache_for(tmp_path: Path, mode: str) -> zstore.CacheConfig | bool:
    if MODES[mode] is False:
        return False
    base = dict(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=tmp_path / "ssd", ssd_bytes="64MB"
    )
    return zstore.CacheConfig(**{**base, **MODES[mode]})


@pytest.fixture
def store_copy(small_store: str, tmp_path: Path) -> Path:
    dst = tmp_path / "copy.zarr"
    shutil.copytree(small_store, dst)
    return dst


# -- 1. a lost object is an error, never zeros ------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("lost", ["shard", "item"])
def test_lost_objects_raise_on_every_read_path(store_copy, tmp_path, mode, lost):
    item = "utt000003"
    if lost == "shard":
        os.unlink(store_copy / item / "wav" / "c" / "0" / "0")
    else:
        shutil.rmtree(store_copy / item)
    ds = zstore.WindowDataset(store_copy, window_seconds=1.0, cache=cache_for(tmp_path, mode))
    index = ds._items.index(item)
    with pytest.raises(zstore.MissingDataError, match=f"{item}.*missing") as err:
        ds[index]
    assert str(store_copy) in str(err.value) and "reconvert" in str(err.value)
    assert not isinstance(err.value, FileNotFoundError)  # zarr would read that as zeros
    with pytest.raises(zstore.MissingDataError):  # and again: nothing was cached
        ds[index]
    other = ds._items.index("utt000001")
    assert ds[other]["wav"].abs().max() > 0  # the rest of the store still reads


@pytest.mark.parametrize("cached", [True, False])
def test_lost_objects_raise_through_the_zarr_api(store_copy, tmp_path, cached):
    os.unlink(store_copy / "utt000002" / "wav" / "c" / "0" / "0")
    cache = cache_for(tmp_path, "decoded-ram") if cached else False
    group = zarr.open_group(zstore.open_store(store_copy, cache=cache), mode="r")
    with pytest.raises(zstore.MissingDataError, match="utt000002"):
        group["utt000002/wav"][:, :100]
    assert np.asarray(group["utt000001/wav"][:, :100]).any()


def test_warm_refuses_to_cache_a_lost_object(store_copy, tmp_path):
    shutil.rmtree(store_copy / "utt000004")
    cache = cache_for(tmp_path, "decoded-ram")
    proc = cli(
        "cache",
        "warm",
        str(store_copy),
        "--no-progress",
        "--ram-dir",
        str(tmp_path / "ram"),
        "--ram-bytes",
        "64MB",
        "--ssd-dir",
        str(tmp_path / "ssd"),
        "--ssd-bytes",
        "64MB",
    )
    assert_one_line_error(proc, "utt000004", "missing")
    ds = zstore.WindowDataset(store_copy, window_seconds=1.0, cache=cache)
    with pytest.raises(zstore.MissingDataError):
        ds[ds._items.index("utt000004")]


def test_silence_is_written_and_read_as_zeros(tmp_path):
    """All-zero chunks are data: the converter writes them, so they are not 'missing'."""
    silent = np.zeros((2, 48000), np.float32)
    loud = np.ones((2, 48000), np.float32)
    src = write_h5(tmp_path / "s.h5", {"quiet": {"wav": silent}, "loud": {"wav": loud}})
    dst = tmp_path / "s.zarr"
    zstore.convert(src, dst, rates={"wav": 16000}, workers=1, progress=False)
    for mode in MODES:
        ds = zstore.WindowDataset(dst, window_seconds=1.0, cache=cache_for(tmp_path / mode, mode))
        got = {ds[i]["item"]: ds[i]["wav"] for i in range(len(ds))}
        assert got["quiet"].abs().max() == 0 and got["loud"].min() == 1


def test_stores_without_the_written_mark_keep_zarr_semantics(store_copy, tmp_path):
    """Stores of other writers (no 'all_chunks_written' in the manifest): a missing chunk
    is the fill value, as in zarr."""
    edit_header(store_copy, lambda h: {k: v for k, v in h.items() if k != "all_chunks_written"})
    os.unlink(store_copy / "utt000003" / "wav" / "c" / "0" / "0")
    ds = zstore.WindowDataset(store_copy, window_seconds=1.0, cache=False)
    assert ds[ds._items.index("utt000003")]["wav"].abs().max() == 0


# -- 2. windows end where every array has data -------------------------------------------


@pytest.fixture(scope="module")
def uneven_store(tmp_path_factory) -> tuple[Path, dict[str, dict[str, np.ndarray]]]:
    """act = ceil(samples / 160) frames: act reaches 100 samples past wav's end, and a
    second item where act has one frame more than wav covers."""
    rng = np.random.default_rng(7)
    items = {
        "ceil": {
            "wav": rng.standard_normal((2, 79900)).astype(np.float32) + 3,
            "act": np.ones((3, 500), np.float32),
        },
        "extra": {
            "wav": rng.standard_normal((2, 80000)).astype(np.float32) + 3,
            "act": np.ones((3, 501), np.float32),
        },
    }
    tmp = tmp_path_factory.mktemp("uneven")
    src = write_h5(tmp / "u.h5", items)
    dst = tmp / "u.zarr"
    zstore.convert(src, dst, rates=RATES, workers=1, progress=False)
    return dst, items


@pytest.mark.parametrize("mode", list(MODES))
def test_windows_never_reach_past_an_array(uneven_store, tmp_path, mode):
    dst, items = uneven_store
    cache = cache_for(tmp_path, mode)
    ds = zstore.WindowDataset(dst, window_seconds=4.9, cache=cache, seed=3)
    lengths = {"ceil": 499, "extra": 500}  # act frames that wav covers in full
    seen_end = set()
    for epoch in range(40):
        ds.set_epoch(epoch)
        for i in range(len(ds)):
            out = ds[i]
            name = out["item"]
            start = round(out["start"] * 100)
            assert start + out["length"] <= lengths[name]
            wav = items[name]["wav"][:, start * 160 : (start + out["length"]) * 160]
            assert np.array_equal(out["wav"].numpy(), wav)
            assert np.array_equal(
                out["act"].numpy(), items[name]["act"][:, start : start + out["length"]]
            )
            seen_end.add((name, start + out["length"] == lengths[name]))
    assert ("ceil", True) in seen_end and ("extra", True) in seen_end


@pytest.mark.parametrize("mode", ["no-cache", "decoded-ram", "encoded-ram"])
def test_padding_past_the_common_end_is_zeros_and_not_counted(uneven_store, tmp_path, mode):
    dst, items = uneven_store
    ds = zstore.WindowDataset(dst, window_seconds=5.01, cache=cache_for(tmp_path, mode))
    for i in range(len(ds)):
        out = ds[i]
        real = out["length"]
        assert real == {"ceil": 499, "extra": 500}[out["item"]]
        assert out["wav"].shape[-1] == 501 * 160 and out["act"].shape[-1] == 501
        assert np.array_equal(
            out["wav"][:, : real * 160].numpy(), items[out["item"]]["wav"][:, : real * 160]
        )
        assert out["wav"][:, real * 160 :].abs().max() == 0
        assert out["act"][:, real:].abs().max() == 0


def test_reader_refuses_spans_past_the_end(uneven_store):
    dst, _ = uneven_store
    reader = zstore.WindowReader(str(dst), cache=None)
    with pytest.raises(ValueError, match="ceil/wav.*outside"):
        reader.read("ceil", {"wav": zstore.format.layout.Span(79000, 80000)})


# -- 3. the converter: orphans and inference ---------------------------------------------


@pytest.mark.skipif(sys.platform != "linux", reason="lists child processes as Linux does")
def test_killed_converter_takes_its_workers_with_it(tmp_path):
    psutil = pytest.importorskip("psutil")
    from zstore.synthetic import SyntheticSpec, make_synthetic

    src = tmp_path / "big.h5"
    make_synthetic(
        src, SyntheticSpec(items=16, mics=4, speakers=2, min_seconds=20, max_seconds=30, seed=5)
    )
    dst = tmp_path / "s.zarr"
    proc = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "zstore.cli",
            "convert",
            str(src),
            str(dst),
            "--rate",
            "wav=16000",
            "--workers",
            "2",
            "--no-progress",
        ],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    parent = psutil.Process(proc.pid)
    workers: list = []

    def spawned(child) -> bool:  # a child may exit (a resource tracker) as it is asked
        try:
            return "spawn" in " ".join(child.cmdline())
        except (psutil.Error, OSError):
            return False

    def started() -> bool:  # the workers exist and have begun writing item groups
        workers[:] = [c for c in parent.children(recursive=True) if spawned(c)]
        return len(workers) >= 2 and any(dst.glob("utt*"))

    kill_when(proc, started)
    assert proc.returncode == -signal.SIGKILL, "the converter finished before it was killed"
    assert workers
    gone, alive = psutil.wait_procs(workers, timeout=60)
    for p in alive:
        p.kill()
    assert not alive, f"{len(alive)} worker(s) outlived the converter"


def test_zero_length_items_do_not_stop_rate_inference(tmp_path):
    rng = np.random.default_rng(0)
    items = {
        f"u{i}": {
            "wav": rng.standard_normal((1, n * 160)).astype(np.float32),
            "act": np.ones((2, n), np.float32),
        }
        for i, n in enumerate([300, 0, 450])
    }
    src = write_h5(tmp_path / "z.h5", items)
    report = zstore.convert(
        src, tmp_path / "z.zarr", rates={"wav": 16000}, workers=1, progress=False
    )
    assert report.arrays["act"].rate == 100 and report.arrays["act"].inferred
    with pytest.warns(UserWarning, match="'u1'"):  # of no samples: not padded
        ds = zstore.WindowDataset(tmp_path / "z.zarr", window_seconds=2.0, fields=["wav", "act"])
    out = next(x for x in (ds[i] for i in range(len(ds))) if x["item"] == "u2")
    assert out["wav"].shape == (1, 32000) and out["act"].shape == (2, 200)


# -- 4. bad input: one line, exit code 2, nothing partial ---------------------------------


@pytest.mark.parametrize(
    "args,words",
    [
        (["--rate", "wav=nan"], ["wav=nan", "positive, finite"]),
        (["--rate", "wav=inf"], ["wav=inf", "positive, finite"]),
        (["--rate", "wav=0.001"], ["wav=0.001", "less than one sample"]),
        (["--rate", "wav=16000", "--chunk-seconds", "nan"], ["--chunk-seconds", "nan"]),
        (["--rate", "wav=16000", "--chunk-seconds", "1e-9"], ["--chunk-seconds", "overhead"]),
        (["--rate", "wav=16000", "--workers", "0"], ["--workers 0", "at least 1"]),
        (["--rate", "wav=16000", "--workers", "-3"], ["--workers -3"]),
        (["--rate", "wav=16000", "--time-axis", "5"], ["--time-axis 5", "dimension"]),
    ],
)
def test_bad_convert_options_leave_nothing(small_h5, tmp_path, args, words):
    dst = tmp_path / "s.zarr"
    proc = cli("convert", small_h5, str(dst), "--no-progress", *args)
    assert_one_line_error(proc, *words)
    assert not dst.exists()


def test_unwritable_destinations(small_h5, tmp_path):
    afile = tmp_path / "file.txt"
    afile.write_text("x")
    assert_one_line_error(cli("convert", small_h5, str(afile), "--rate", "wav=16000"), "is a file")
    assert_one_line_error(
        cli("convert", small_h5, str(afile / "s.zarr"), "--rate", "wav=16000"),
        "lies under",
        "file.txt",
    )
    assert_one_line_error(
        cli("convert", small_h5, "/proc/zstore-test.zarr", "--rate", "wav=16000"), "/proc"
    )
    assert afile.read_text() == "x"


def test_destination_without_write_permission(small_h5, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() == 0:  # root writes through permission bits: use a read-only mount
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(locked)], capture_output=True
        )
        if mounted.returncode != 0:
            pytest.skip("running as root without a way to mount a read-only directory")
    else:
        os.chmod(locked, 0o555)
    try:
        proc = cli("convert", small_h5, str(locked / "s.zarr"), "--rate", "wav=16000")
        assert_one_line_error(proc, "cannot write", str(locked))
        assert os.listdir(locked) == []
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(locked)], check=True)
        else:
            os.chmod(locked, 0o755)


def test_truncated_root_metadata(store_copy):
    root = store_copy / "zarr.json"
    root.write_bytes(root.read_bytes()[:200])
    with pytest.raises(zstore.StoreFormatError, match="zarr.json is not valid JSON"):
        zstore.WindowDataset(store_copy, cache=False)
    assert_one_line_error(cli("info", str(store_copy)), "zarr.json", "restore")


@pytest.mark.parametrize("window", [0, -1.0, float("nan"), float("inf"), "10", True, 1e9])
def test_bad_window_seconds(small_store, window):
    with pytest.raises(zstore.ConfigError, match="window_seconds"):
        zstore.WindowDataset(small_store, window_seconds=window, cache=False)


@pytest.mark.parametrize("seed", ["x", 1.7, None])
def test_bad_seed(small_store, seed):
    with pytest.raises(zstore.ConfigError, match="seed must be a whole number"):
        zstore.WindowDataset(small_store, seed=seed, cache=False)


def test_seed_and_epoch_accept_numpy_integers(small_store):
    ds = zstore.WindowDataset(small_store, seed=np.int64(3), cache=False)
    ds.set_epoch(np.int32(2))
    assert (ds.seed, ds.epoch) == (3, 2)
    with pytest.raises(zstore.ConfigError, match="epoch"):
        ds.set_epoch(1.5)


@pytest.mark.parametrize(
    "env,value,words",
    [
        ("ZSTORE_MAX_REQUESTS", "abc", ["ZSTORE_MAX_REQUESTS", "whole number"]),
        ("ZSTORE_MAX_REQUESTS", "0", ["ZSTORE_MAX_REQUESTS", "from 1"]),
        ("ZSTORE_RAM_BYTES", "-1", ["ZSTORE_RAM_BYTES", "negative"]),
        ("ZSTORE_SSD_BYTES", "lots", ["ZSTORE_SSD_BYTES", "size"]),
        ("ZSTORE_RAM_FORMAT", "zipped", ["ZSTORE_RAM_FORMAT"]),
    ],
)
def test_bad_environment_names_the_variable(monkeypatch, tmp_path, env, value, words):
    monkeypatch.setenv(env, value)
    with pytest.raises(zstore.ConfigError) as err:
        zstore.CacheConfig(ram_dir=tmp_path / "r", ssd_dir=tmp_path / "s").resolved()
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -5, "-1GB", [1]])
def test_bad_byte_counts(tmp_path, value):
    with pytest.raises(zstore.ConfigError, match="ram_bytes"):
        zstore.CacheConfig(ram_dir=tmp_path / "r", ram_bytes=value).resolved()


def test_bad_cache_options_from_the_cli(small_store, tmp_path):
    proc = cli("cache", "stats", "--ram-dir", str(tmp_path / "r"), "--ram-bytes", "-1")
    assert_one_line_error(proc, "ram_bytes", "negative")
