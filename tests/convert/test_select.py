"""Which items a conversion takes: --include / --exclude patterns."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import assert_one_line_error, cli, manifest_of, write_h5

import zstore


def corpus(path, seed: int = 0, prefix: str = "spk") -> dict:
    rng = np.random.default_rng(seed)
    items = {
        f"{prefix}{s}/utt{i}": {"wav": rng.integers(-900, 900, (1, 16000 * (1 + i)), np.int16)}
        for s in range(2)
        for i in range(3)
    }
    items["meta"] = {"wav": np.zeros((3,), np.float64)}  # not a recording: clashes
    write_h5(path, items)
    return items


def test_a_group_that_clashes_is_named_and_left_out(tmp_path):
    items = corpus(tmp_path / "a.h5")
    with pytest.raises(zstore.SourceError, match=r"--exclude 'meta'"):
        zstore.convert(tmp_path / "a.h5", tmp_path / "x.zarr", rates={"wav": 16000})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # left out as asked: said in the report, not warned
        report = zstore.convert(
            tmp_path / "a.h5",
            tmp_path / "a.zarr",
            rates={"wav": 16000},
            exclude=["meta"],
            progress=False,
        )
    assert report.items == 6
    assert "1 item(s) (meta): left out by --include/--exclude" in str(report)
    assert sorted(manifest_of(tmp_path / "a.zarr").items) == sorted(n for n in items if n != "meta")
    again = cli(
        "convert", str(tmp_path / "a.h5"), str(tmp_path / "a.zarr"), "--rate", "wav=16000",
        "--exclude", "meta", "--no-progress",
    )  # fmt: skip
    assert again.returncode == 0 and "0 converted" in again.stdout  # a rerun resumes
    other = cli(
        "convert", str(tmp_path / "a.h5"), str(tmp_path / "a.zarr"), "--rate", "wav=16000",
        "--include", "spk0/*",
    )  # fmt: skip
    assert_one_line_error(other, "converted otherwise", "--overwrite")


def test_include_patterns_and_an_append(tmp_path):
    first = corpus(tmp_path / "a.h5", seed=1)
    zstore.convert(
        tmp_path / "a.h5",
        tmp_path / "s.zarr",
        rates={"wav": 16000},
        include=["spk1/*"],
        progress=False,
    )
    assert sorted(manifest_of(tmp_path / "s.zarr").items) == [f"spk1/utt{i}" for i in range(3)]
    corpus(tmp_path / "b.h5", seed=2, prefix="new")
    report = zstore.append(
        tmp_path / "b.h5", tmp_path / "s.zarr", include=["new0/*"], progress=False
    )
    assert report.converted == 3
    ds = zstore.WindowDataset(tmp_path / "s.zarr", window_seconds=None, cache=False)
    assert len(ds) == 6
    for i in range(len(ds)):
        x = ds[i]
        if x["item"].startswith("spk1/"):
            np.testing.assert_array_equal(x["wav"].numpy(), first[x["item"]]["wav"])
    with pytest.raises(zstore.SourceError, match="no item is left by --include"):
        zstore.convert(tmp_path / "a.h5", tmp_path / "t.zarr", include=["nothing*"])


def test_items_left_out_of_several_files_are_named_as_the_store_names_them(tmp_path):
    """With several files, the report's and the error's items are ``<file stem>/<group>``
    (they said ``spk0/utt0`` for each file's alike)."""
    corpus(tmp_path / "a.h5")
    corpus(tmp_path / "b.h5", seed=1)
    files = [tmp_path / "a.h5", tmp_path / "b.h5"]
    report = zstore.convert(
        files, tmp_path / "s.zarr", rates={"wav": 16000}, include=["a/spk*"], progress=False
    )
    assert "8 item(s) (a/meta, b/meta, b/spk0/utt0 and 5 more)" in str(report)
    with pytest.raises(zstore.SourceError, match=r"items: 'a/meta', 'a/spk0/utt0', "):
        zstore.convert(files, tmp_path / "t.zarr", rates={"wav": 16000}, include=["zz*"])
