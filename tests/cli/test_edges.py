"""Rough edges a new user hits: a store without time arrays, cache stats of another
job, a budget larger than its tmpfs, pipes, --help and --version, whole-item batches."""

from __future__ import annotations

import argparse
import importlib.resources
import json
import subprocess

import numpy as np
import pytest
import torch
from conftest import PYTHON, edit_header, subprocess_env, write_h5, zstore_cli

import zstore


def test_convert_without_rates_is_refused(tmp_path):
    src = write_h5(
        tmp_path / "a.h5",
        {"u0": {"wav": np.zeros((2, 32000), np.float32), "act": np.zeros((3, 200), np.float32)}},
    )
    dst = tmp_path / "a.zarr"
    proc = zstore_cli("convert", src, str(dst))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert "--rate wav=16000" in proc.stderr and "(2, 32000)" in proc.stderr
    assert not dst.exists()


def test_a_store_without_time_arrays_says_how_to_reconvert(small_store, tmp_path):
    import shutil

    store = tmp_path / "s.zarr"
    shutil.copytree(small_store, store)
    edit_header(
        store,
        lambda h: {
            **h,
            "arrays": {n: {**a, "rate": None, "time_axis": None} for n, a in h["arrays"].items()},
        },
    )
    with pytest.raises(zstore.ConfigError, match="no time arrays.*reconvert.*--rate"):
        zstore.WindowDataset(store, cache=False)


def test_cache_stats_shows_the_jobs_budget_and_this_runs_numbers(small_store, tmp_path):
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=tmp_path / "ssd", ssd_bytes="96MB"
    )
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=cfg)
    for _ in range(2):  # the first passes fill the tiers (the very first read writes
        [ds[i] for i in range(len(ds))]  # nothing: its chunks go in when read again)
    assert ds.settle(timeout=120)  # (the RAM tier behind its reads)
    dirs = ["--ram-dir", str(tmp_path / "ram"), "--ssd-dir", str(tmp_path / "ssd")]
    assert zstore_cli("cache", "mark", *dirs).returncode == 0
    [ds[i] for i in range(len(ds))]  # this run: all hits
    stats = json.loads(zstore_cli("cache", "stats", "--json", *dirs).stdout)
    assert stats["ram"]["budget"] == 64_000_000 and stats["ssd"]["budget"] == 96_000_000
    assert stats["ram"]["budget_of"] == "the job"
    assert stats["since_mark"]["ram"]["hit_rate"] == 1.0
    assert stats["since_mark"]["origin"]["requests"] == 0
    assert stats["ram"]["hit_rate"] < 1.0  # the totals include the filling pass
    assert stats["running"]["ram"]["hits"] > 0  # this process is still running
    text = zstore_cli("cache", "stats", *dirs).stdout
    assert "since the mark: hits" in text and "hit rate 100.0%" in text
    assert "budget of the job" in text


def test_a_budget_larger_than_its_file_system_keeps_to_the_file_system(small_store, tmp_path):
    """A budget the file system cannot hold would fill it, and a full file system stops
    the tier (its index and every write fail): the tier keeps to 90% of it, and says so."""
    import shutil

    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="900TB", ssd_dir=tmp_path / "ssd", ssd_bytes="900TB"
    )
    with pytest.warns(UserWarning) as caught:
        resolved = cfg.resolved()
    said = [str(w.message) for w in caught]
    assert any(
        "RAM tier" in m
        and "(818.5 TiB, ram_bytes) is larger than the file system" in m
        and "keeps to" in m
        and "remount" in m
        for m in said
    ), said
    assert any("SSD tier" in m and "ssd_bytes" in m for m in said), said
    cap = int(shutil.disk_usage(tmp_path).total * 0.9)
    assert resolved.ram_bytes == resolved.ssd_bytes == cap
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=cfg)
    first = [ds[i]["wav"].numpy() for i in range(len(ds))]
    assert all(np.array_equal(a, ds[i]["wav"].numpy()) for i, a in enumerate(first))
    stats = zstore.cache_stats(cfg)
    assert stats["ram"]["budget"] == cap and stats["ram"]["hits"] > 0


def test_info_into_a_closed_pipe_is_quiet(small_store):
    proc = subprocess.Popen(
        [PYTHON, "-m", "zstore.cli", "info", small_store, "--json"],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # like `| head` leaving before zstore writes
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=300) == 0
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_version_and_help_texts():
    out = zstore_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"zstore {zstore.__version__}"
    top = zstore_cli("--help").stdout
    assert "``" not in top
    from zstore.cli import build_parser

    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    for parser in parsers(build_parser()):
        for action in parser._actions:
            if action.option_strings or action.dest not in ("command", "cache_command"):
                assert action.help, (parser.prog, action.option_strings or action.dest)
    assert "--ram-bytes" not in zstore_cli("cache", "clear", "--help").stdout
    assert "ZSTORE_SSD_DIR" in zstore_cli("cache", "stats", "--help").stdout


def test_collate_pad_batches_whole_items(small_store):
    ds = zstore.WindowDataset(small_store, window_seconds=None, cache=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=3, collate_fn=zstore.collate_pad)
    for batch in loader:
        lengths = batch["wav_length"].tolist()
        assert batch["wav"].shape[-1] == max(lengths)
        for b, item in enumerate(batch["item"]):
            whole = ds[ds._items.index(item)]["wav"]
            assert torch.equal(batch["wav"][b, :, : lengths[b]], whole)
            assert batch["wav"][b, :, lengths[b] :].abs().sum() == 0


def test_type_hints_are_shipped():
    assert importlib.resources.files("zstore").joinpath("py.typed").is_file()
