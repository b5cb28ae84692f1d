"""Many HDF5 sources as one store: files, directories, globs; names and collisions."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from conftest import corpus_files, manifest_of, write_h5, zstore_cli

import zstore


def test_a_directory_of_files_with_overlapping_group_names(tmp_path):
    data = corpus_files(tmp_path)
    dst = tmp_path / "s.zarr"
    report = zstore.convert(
        tmp_path / "corpus",
        dst,
        rates={"wav": 16000},
        workers=2,
        progress=False,
        verify=True,
        pack_seconds=0,  # the item groups' names are what is tested
    )
    assert report.items == 4 and len(report.sources) == 3 and "sources: 3 file(s)" in str(report)
    root = zarr.open_group(dst, mode="r")
    manifest = manifest_of(dst)
    assert list(manifest.items) == ["a/rec0", "a/rec1", "b/rec0", "c/spk/rec9"]
    assert len(manifest.extra["sources"]) == 3
    for stem, groups in data.items():
        for group, arrays in groups.items():
            assert np.array_equal(root[f"{stem}/{group}/wav"][...], arrays["wav"])
    ds = zstore.WindowDataset(dst, window_seconds=1.0, cache=False)
    assert sorted(ds[i]["item"] for i in range(len(ds))) == list(manifest.items)


def test_globs_and_lists_on_the_command_line(tmp_path):
    corpus_files(tmp_path)
    dst = tmp_path / "g.zarr"
    proc = zstore_cli(
        "convert",
        str(tmp_path / "corpus" / "*.h5"),
        str(tmp_path / "corpus" / "day2" / "c.h5"),
        str(dst),
        "--rate",
        "wav=16000",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr
    items = list(manifest_of(dst).items)
    assert items == ["a/rec0", "a/rec1", "c/spk/rec9"]
    again = zstore_cli(
        "convert",
        str(tmp_path / "corpus" / "*.h5"),
        str(tmp_path / "corpus" / "day2" / "c.h5"),
        str(dst),
        "--rate",
        "wav=16000",
        "--no-progress",
    )
    assert again.returncode == 0 and "(0 converted, 3 already done)" in again.stdout


def test_one_file_keeps_plain_group_names(tmp_path):
    corpus_files(tmp_path)
    dst = tmp_path / "one.zarr"
    zstore.convert(
        [tmp_path / "corpus" / "a.h5"], dst, rates={"wav": 16000}, workers=1, progress=False
    )
    assert list(manifest_of(dst).items) == ["rec0", "rec1"]


def test_bad_source_lists(tmp_path):
    corpus_files(tmp_path)
    (tmp_path / "other").mkdir()
    write_h5(tmp_path / "other" / "a.h5", {"x": {"wav": np.zeros((1, 32000), np.float32)}})
    proc = zstore_cli(
        "convert",
        str(tmp_path / "corpus" / "a.h5"),
        str(tmp_path / "other" / "a.h5"),
        str(tmp_path / "d.zarr"),
        "--rate",
        "wav=16000",
    )
    assert proc.returncode == 2 and "the stem 'a'" in proc.stderr
    assert not (tmp_path / "d.zarr").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = zstore_cli("convert", str(empty), str(tmp_path / "e.zarr"), "--rate", "wav=16000")
    assert proc.returncode == 2 and "no *.h5" in proc.stderr
    proc = zstore_cli(
        "convert", str(tmp_path / "nothing*.h5"), str(tmp_path / "f.zarr"), "--rate", "wav=16000"
    )
    assert proc.returncode == 2 and "matches no file" in proc.stderr
    proc = zstore_cli("convert", str(tmp_path / "f.zarr"))
    assert proc.returncode == 2 and "SRC... DST" in proc.stderr


def test_uneven_groups(tmp_path):
    rng = np.random.default_rng(3)

    def item(n, **extra):
        return {
            "wav": rng.standard_normal((1, n * 160)).astype(np.float32),
            "act": np.ones((2, n), np.float32),
            **extra,
        }

    src = write_h5(
        tmp_path / "u.h5",
        {
            "rec0": item(300, meta=np.arange(4), aux=np.ones((1, 300 * 2), np.float32)),
            "rec1": item(400, aux=np.ones((1, 400 * 2), np.float32)),
            "rec2": item(500),
        },
    )
    dst = tmp_path / "u.zarr"
    report = zstore.convert(
        src, dst, rates={"wav": 16000}, workers=1, progress=False, verify=True, pack_seconds=0
    )
    assert report.arrays["aux"].rate == 200 and report.arrays["aux"].inferred
    root = zarr.open_group(dst, mode="r")
    assert "meta" in root["rec0"] and "meta" not in root["rec1"]
    text = zstore_cli("info", str(dst)).stdout
    assert "meta:" in text and "in 1 of 3 items" in text and "in 2 of 3 items" in text
    ds = zstore.WindowDataset(dst, window_seconds=1.0, cache=False)  # wav, act: every item
    assert len(ds) == 3 and set(ds[0]) >= {"wav", "act"} and "aux" not in ds[0]
    with pytest.raises(zstore.ConfigError, match=r"1 of 3 item\(s\) lack.*'rec2'.*missing='skip'"):
        zstore.WindowDataset(dst, window_seconds=1.0, cache=False, fields=["wav", "aux"])
    with pytest.warns(UserWarning, match="left out"):
        some = zstore.WindowDataset(
            dst, window_seconds=1.0, cache=False, fields=["wav", "aux"], missing="skip"
        )
    assert sorted(some[i]["item"] for i in range(len(some))) == ["rec0", "rec1"]
    assert some[0]["aux"].shape == (1, 200)
    # an item list counts its own items only: none of these lacks aux, so no error
    # naming rec2, which was not asked for; one that does is named, of the list's count
    chosen = zstore.WindowDataset(
        dst, window_seconds=1.0, cache=False, fields=["wav", "aux"], items=["rec1", "rec0"]
    )
    assert [chosen[i]["item"] for i in range(2)] == ["rec1", "rec0"]
    with pytest.raises(zstore.ConfigError, match=r"1 of 2 item\(s\) lack.*'rec2'"):
        zstore.WindowDataset(
            dst, window_seconds=1.0, cache=False, fields=["wav", "aux"], items=["rec2", "rec0"]
        )
    warmed = zstore_cli(
        "cache",
        "warm",
        str(dst),
        "--no-progress",
        "--fields",
        "wav",
        "aux",
        "--ram-dir",
        str(tmp_path / "ram"),
        "--ram-bytes",
        "64MB",
        "--ssd-dir",
        "none",
    )
    assert warmed.returncode == 0, warmed.stderr


def test_uneven_dtypes_are_an_error_naming_both_items(tmp_path):
    src = write_h5(
        tmp_path / "d.h5",
        {
            "a": {"wav": np.zeros((1, 16000), np.float32)},
            "b": {"wav": np.zeros((1, 16000), np.int16)},
        },
    )
    proc = zstore_cli("convert", src, str(tmp_path / "d.zarr"), "--rate", "wav=16000")
    assert proc.returncode == 2 and "'b/wav'" in proc.stderr and "'a/wav'" in proc.stderr


def test_append_while_a_reader_stays_open(tmp_path):
    data = corpus_files(tmp_path)
    dst = tmp_path / "s.zarr"
    corpus = tmp_path / "corpus"
    zstore.convert(
        [corpus / "a.h5", corpus / "b.hdf5"], dst, rates={"wav": 16000}, workers=1, progress=False
    )
    before = manifest_of(dst)
    cfg = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=None)
    reader = zstore.WindowDataset(dst, window_seconds=1.0, cache=cfg)
    first = [reader[i]["wav"].clone() for i in range(len(reader))]
    proc = zstore_cli(
        "convert", str(corpus / "day2" / "c.h5"), str(dst), "--append", "--verify", "--no-progress"
    )
    assert proc.returncode == 0, proc.stderr
    after = manifest_of(dst)
    assert after.store_id == before.store_id  # cached chunks stay valid
    assert list(after.items) == list(before.items) + ["c/spk/rec9"]
    assert len(reader) == 3 and all(  # the open reader keeps its view
        torch_equal(reader[i]["wav"], first[i]) for i in range(3)
    )
    fresh = zstore.WindowDataset(dst, window_seconds=1.0, cache=cfg)
    assert len(fresh) == 4
    got = fresh[3]
    start = round(got["start"] * 16000)
    assert np.array_equal(
        got["wav"].numpy(), data["c"]["spk/rec9"]["wav"][:, start : start + 16000]
    )
    # the same again: the file is in the store already, unchanged; nothing changes
    again = zstore_cli("convert", str(corpus / "day2" / "c.h5"), str(dst), "--append")
    assert again.returncode == 0 and "already in the store" in again.stdout
    assert list(manifest_of(dst).items) == list(after.items)


def test_append_refuses_and_leaves_the_store_untouched(tmp_path):
    corpus_files(tmp_path)
    dst = tmp_path / "one.zarr"
    corpus = tmp_path / "corpus"
    zstore.convert(corpus / "a.h5", dst, rates={"wav": 16000}, workers=1, progress=False)
    snapshot = {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    proc = zstore_cli("convert", str(corpus / "b.hdf5"), str(dst), "--append")
    assert proc.returncode == 2 and "'rec0'" in proc.stderr and "nothing was written" in proc.stderr
    assert {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()} == snapshot
    proc = zstore_cli("convert", str(corpus / "a.h5"), str(tmp_path / "none.zarr"), "--append")
    assert proc.returncode == 2 and "no finished zstore store" in proc.stderr


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_a_directory_leaves_out_hidden_files_and_reads_each_file_once(tmp_path):
    """As copied in from elsewhere: macOS AppleDouble files (``._a.h5``) and a hidden
    directory are not HDF5 sources of the corpus, and a link to a file already listed
    (a symbolic or hard link under another name) would add its recordings twice."""
    data = corpus_files(tmp_path)
    corpus = tmp_path / "corpus"
    (corpus / "._a.h5").write_bytes(b"\x00\x05\x16\x07" + bytes(100))  # AppleDouble
    (corpus / ".ipynb_checkpoints").mkdir()
    write_h5(corpus / ".ipynb_checkpoints" / "d.h5", {"x": {"wav": np.zeros((1, 3200), "f4")}})
    (corpus / "day2" / "again.h5").symlink_to(corpus / "a.h5")
    (corpus / "hard.h5").hardlink_to(corpus / "b.hdf5")
    dst = tmp_path / "s.zarr"
    with pytest.warns(UserWarning) as caught:
        report = zstore.convert(
            corpus, dst, rates={"wav": 16000}, workers=1, progress=False, pack_seconds=0
        )
    said = [str(w.message) for w in caught]
    assert any("again.h5" in s and "a.h5" in s and "the same file" in s for s in said), said
    assert any("hard.h5" in s and "b.hdf5" in s for s in said), said
    assert sorted(manifest_of(dst).items) == ["a/rec0", "a/rec1", "b/rec0", "c/spk/rec9"]
    assert report.items == 4 and len(report.sources) == 3
    root = zarr.open_group(dst, mode="r")
    assert np.array_equal(root["a/rec1/wav"][...], data["a"]["rec1"]["wav"])
    # a hidden file named on its own is read: it was asked for
    write_h5(tmp_path / ".one.h5", {"x": {"wav": np.ones((1, 3200), "f4")}})
    zstore.convert(
        tmp_path / ".one.h5", tmp_path / "h.zarr", rates={"wav": 16000}, workers=1, progress=False
    )
    assert list(manifest_of(tmp_path / "h.zarr").items) == ["x"]


def test_every_unreadable_source_named_at_once(tmp_path):
    corpus_files(tmp_path)
    corpus = tmp_path / "corpus"
    (corpus / "empty.h5").write_bytes(b"")
    (corpus / "day2" / "cut.h5").write_bytes((corpus / "a.h5").read_bytes()[:1000])
    proc = zstore_cli("convert", str(corpus), str(tmp_path / "s.zarr"), "--rate", "wav=16000")
    assert proc.returncode == 2
    assert "2 of 5 sources cannot be converted" in proc.stderr, proc.stderr
    assert "empty.h5: the file is empty" in proc.stderr and "cut.h5: cannot be read" in proc.stderr
    assert not (tmp_path / "s.zarr").exists()


def test_a_directory_of_hdf5_files_named_otherwise_says_the_pattern(tmp_path):
    """MATLAB's v7.3 files are HDF5 with a 512-byte user block, named *.mat: a directory
    of them has no *.h5, and the error names them and the pattern that reads them."""
    import h5py

    mats = tmp_path / "mats"
    (mats / "day1").mkdir(parents=True)
    for i in range(3):
        with h5py.File(mats / "day1" / f"rec{i}.mat", "w", userblock_size=512) as f:
            f["acc"] = np.arange(3 * 2000, dtype="f8").reshape(3, 2000) + i
    (mats / "notes.txt").write_text("not HDF5")
    (mats / "old.mat").write_bytes(b"MATLAB 5.0 MAT-file" + bytes(200))  # v5: not HDF5
    proc = zstore_cli("convert", str(mats), str(tmp_path / "s.zarr"), "--rate", "acc=1000")
    assert proc.returncode == 2
    pattern = f"{mats}/**/*.mat"
    assert "no *.h5 or *.hdf5 file below it" in proc.stderr, proc.stderr
    assert "3 *.mat: rec0.mat, rec1.mat, ..." in proc.stderr and pattern in proc.stderr
    with pytest.raises(zstore.SourceError, match="old.mat"):  # the pattern takes it too
        zstore.convert(pattern, tmp_path / "s.zarr", rates={"acc": 1000}, progress=False)
    (mats / "old.mat").unlink()
    report = zstore.convert(
        pattern, tmp_path / "s.zarr", rates={"acc": 1000}, workers=1, progress=False
    )
    assert report.items == 3
    # a directory of no HDF5 at all: the plain error
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("x")
    proc = zstore_cli("convert", str(tmp_path / "text"), str(tmp_path / "t.zarr"))
    assert proc.returncode == 2 and "named otherwise" not in proc.stderr, proc.stderr
