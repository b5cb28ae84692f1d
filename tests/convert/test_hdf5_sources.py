"""HDF5 files as they come (metadata arrays, embeddings, arrays in some groups, dimension
scales, links, non-finite attributes), converted with only the real rate given, and the
store read by other Zarr tools: zarr-python, TensorStore, xarray, a strict JSON parser."""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import multiprocessing as mp
import subprocess
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr
from conftest import PYTHON, assert_one_line_error, cli, manifest_of, subprocess_env, write_h5

import zstore


def speech(path: Path, seconds: list[float], extra=None) -> str:
    """Items of int16-valued and true-float audio, ``act`` at 100/s, plus ``extra(g, i)``."""
    rng = np.random.default_rng(5)
    with h5py.File(path, "w") as f:
        for i, sec in enumerate(seconds):
            g = f.create_group(f"rec_{i:03d}")
            n = int(sec * 16000)
            wav = (
                rng.integers(-3000, 3000, (2, n)) / 32768
                if i % 2
                else rng.standard_normal((2, n)) * 0.1
            )
            g["wav"] = wav.astype(np.float32)
            g["act"] = (rng.random((2, n // 160)) > 0.5).astype(np.float32)
            if extra:
                extra(g, i)
    return str(path)


def strict(raw: bytes) -> object:
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(raw, parse_constant=refuse)


def test_a_metadata_array_in_one_group_is_stored_whole(tmp_path):
    src = speech(
        tmp_path / "a.h5",
        [2.0, 3.0, 4.0],
        lambda g, i: g.create_dataset("meta", data=np.arange(6)) if i == 1 else None,
    )
    proc = cli("convert", src, str(tmp_path / "a.zarr"), "--rate", "wav=16000", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "meta: stored whole" in proc.stdout and "--rate meta=" in proc.stdout
    assert "act: time array at 100/s (inferred)" in proc.stdout
    m = manifest_of(tmp_path / "a.zarr")
    assert m.arrays["meta"].rate is None and m.arrays["act"].rate == 100
    info = cli("info", str(tmp_path / "a.zarr"))
    assert "meta: no time axis" in info.stdout and "in 1 item(s)" in info.stdout
    ds = zstore.WindowDataset(
        tmp_path / "a.zarr", window_seconds=1.0, cache=False, fields=["wav", "meta"], missing="skip"
    )
    got = ds[0]
    assert got["wav"].shape == (2, 16000) and got["meta"].tolist() == list(range(6))


def test_embeddings_in_segments_of_one_length_are_stored_whole(tmp_path):
    """A 10-value embedding in every 3 s segment was a 3.33/s time array, and 1 s windows
    came out 0.9 s long; ``act``'s ratio cannot be proven by one length either."""
    src = speech(
        tmp_path / "seg.h5",
        [3.0] * 4,
        lambda g, i: g.create_dataset("emb", data=np.ones(10, np.float32)),
    )
    report = zstore.convert(
        src, tmp_path / "seg.zarr", rates={"wav": 16000}, workers=1, progress=False
    )
    text = str(report)
    assert report.arrays["emb"].rate is None and report.arrays["act"].rate is None
    assert "--rate act=RATE (100 if it is)" in text
    ds = zstore.WindowDataset(tmp_path / "seg.zarr", window_seconds=1.0, cache=False)
    assert set(ds[0]) >= {"wav"} and "emb" not in ds[0] and "act" not in ds[0]
    assert ds[0]["wav"].shape == (2, 16000) and ds[0]["length"] == 16000
    again = zstore.convert(
        src, tmp_path / "seg2.zarr", rates={"wav": 16000, "act": 100}, workers=1, progress=False
    )
    assert again.arrays["act"].rate == 100 and again.arrays["emb"].rate is None


def test_an_embedding_in_items_of_different_lengths_is_stored_whole(tmp_path):
    src = speech(
        tmp_path / "e.h5",
        [2.0, 2.5, 3.5],
        lambda g, i: g.create_dataset("emb", data=np.ones(192, np.float32)),
    )
    report = zstore.convert(
        src, tmp_path / "e.zarr", rates={"wav": 16000}, workers=1, progress=False
    )
    assert report.arrays["emb"].rate is None and report.arrays["act"].rate == 100
    batch = zstore.WindowDataset(tmp_path / "e.zarr", window_seconds=1.0, cache=False)[1]
    assert "emb" not in batch and batch["act"].shape == (2, 100)


@pytest.mark.parametrize("how", [["--rate", "act=none"], ["--static", "act"]])
def test_an_array_can_be_kept_whole_explicitly(tmp_path, how):
    src = speech(tmp_path / "s.h5", [2.0, 3.0])
    proc = cli(
        "convert", src, str(tmp_path / "s.zarr"), "--rate", "wav=16000", "--no-progress", *how
    )
    assert proc.returncode == 0, proc.stderr
    assert "act: stored whole, as asked" in proc.stdout
    assert manifest_of(tmp_path / "s.zarr").arrays["act"].rate is None
    py = zstore.convert(
        src, tmp_path / "p.zarr", rates={"wav": 16000, "act": None}, workers=1, progress=False
    )
    assert py.arrays["act"].rate is None


def test_links_are_followed_or_named(tmp_path):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x/wav"] = np.zeros((2, 16000), np.float32)
    src = speech(tmp_path / "l.h5", [1.0, 2.0, 3.0])
    with h5py.File(src, "a") as f:
        f["rec_alias"] = f["rec_001"]  # a group under two names
        f["rec_soft/wav"] = h5py.SoftLink("/rec_000/wav")  # soft-linked datasets
        f["rec_soft/act"] = h5py.SoftLink("/rec_000/act")
        f["rec_ext"] = h5py.ExternalLink(str(other), "/x")  # another file
        f["rec_gone/wav"] = h5py.SoftLink("/nowhere")  # dangling
    proc = cli(
        "convert", src, str(tmp_path / "l.zarr"), "--rate", "wav=16000", "--no-progress", "--verify"
    )
    assert proc.returncode == 0, proc.stderr
    items = list(manifest_of(tmp_path / "l.zarr").items)
    assert items == ["rec_000", "rec_001", "rec_002", "rec_soft"]  # no item vanished
    skipped = manifest_of(tmp_path / "l.zarr").extra["skipped"]
    said = "\n".join(skipped)
    assert "rec_alias: the same group as 'rec_001'" in said
    assert f"rec_ext: external link to {other}:/x" in said
    assert "rec_gone/wav: soft link to /nowhere" in said
    for line in ("rec_alias", "rec_ext", "rec_gone"):
        assert line in proc.stdout
    ds = zstore.WindowDataset(tmp_path / "l.zarr", window_seconds=None, cache=False)
    with h5py.File(src) as f:
        assert np.array_equal(ds[3]["wav"].numpy(), f["rec_000/wav"][()])
    assert "left out of the sources" in cli("info", str(tmp_path / "l.zarr")).stdout


def scaled(g, i):
    g["frame"] = np.arange(g["act"].shape[1], dtype=np.float64) / 100
    g["frame"].make_scale("frame time")
    g["act"].dims[1].attach_scale(g["frame"])
    g["act"].dims[0].label = "speaker"
    g["wav"].dims[0].label = "mic"
    g.attrs["snr"] = np.nan
    g.attrs["gains"] = np.array([1.0, np.inf, -np.inf])
    g.attrs["source"] = g["wav"].ref
    g["wav"].attrs["peak"] = np.float32("nan")


@pytest.fixture
def odd_store(tmp_path) -> tuple[str, Path]:
    src = speech(tmp_path / "odd.h5", [2.0, 3.0, 2.5], scaled)
    dst = tmp_path / "odd.zarr"
    proc = cli(
        "convert",
        src,
        str(dst),
        "--rate",
        "wav=16000",
        "--no-progress",
        "--verify",
        "--pack-seconds",
        "0",
    )  # fmt: skip  (each item's group is what is tested)
    assert proc.returncode == 0, proc.stderr
    return src, dst


def test_attributes_are_strict_json_and_read_back_as_floats(odd_store):
    src, dst = odd_store
    for meta in dst.rglob("zarr.json"):
        strict(meta.read_bytes())  # zarrs and TensorStore refuse bare NaN
    group = strict((dst / "rec_000" / "zarr.json").read_bytes())["attributes"]
    assert group["snr"] == "NaN" and group["gains"] == [1.0, "Infinity", "-Infinity"]
    assert group["source"] == "/rec_000/wav"
    act = strict((dst / "rec_000" / "act" / "zarr.json").read_bytes())
    assert act["attributes"]["DIMENSION_LIST"] == [[], ["/rec_000/frame"]]
    seen = {}

    def keep(name, attrs):
        seen[name] = attrs
        return math.isnan(attrs["snr"])

    ds = zstore.WindowDataset(dst, window_seconds=1.0, cache=False, items=keep)
    assert len(ds) == 3 and seen["rec_000"]["gains"] == [1.0, math.inf, -math.inf]


def test_other_zarr_readers_read_the_store_bit_identical(odd_store):
    ts = pytest.importorskip("tensorstore")
    src, dst = odd_store
    root = zarr.open_group(dst, mode="r")
    with h5py.File(src) as f:
        for item in ("rec_000", "rec_001", "rec_002"):
            for name in ("wav", "act", "frame"):
                want = f[f"{item}/{name}"][()]
                assert np.array_equal(root[f"{item}/{name}"][...], want)
                spec = {
                    "driver": "zarr3",
                    "kvstore": {"driver": "file", "path": str(dst / item / name)},
                }
                got = ts.open(spec, read=True).result().read().result()
                assert got.dtype == want.dtype and np.array_equal(got, want)


def test_xarray_opens_an_item_group(odd_store):
    xr = pytest.importorskip("xarray")
    src, dst = odd_store
    x = xr.open_zarr(dst, group="rec_001", consolidated=False)
    assert x["wav"].dims == ("mic", "wav_time") and x["act"].dims[0] == "speaker"
    assert x.sizes["wav_time"] == 48000 and x["act"].shape == (2, 300)
    with h5py.File(src) as f:
        assert np.array_equal(x["wav"].values, f["rec_001/wav"][()])
    plain = zstore.convert(
        speech(dst.parent / "plain.h5", [1.0, 2.0]),
        dst.parent / "p.zarr",
        rates={"wav": 16000},
        workers=1,
        progress=False,
        pack_seconds=0,  # xarray opens an item's group
    )
    assert plain.arrays["wav"].dims == ("wav_dim0", "wav_time")
    y = xr.open_zarr(dst.parent / "p.zarr", group="rec_000", consolidated=False)
    assert y["act"].dims == ("act_dim0", "act_time")


class _Inline(cf.Executor):
    """Runs each task as it is submitted, in this process: none is left for the
    scanning process to take back, so every part goes through a worker's path."""

    def submit(self, fn, /, *args, **kwargs):
        future: cf.Future = cf.Future()
        future.set_running_or_notify_cancel()
        future.set_result(fn(*args, **kwargs))
        return future


def test_a_large_file_walked_in_parts_scans_as_one_walk(tmp_path, monkeypatch):
    """A large local file is walked in parts (root-level links shared out to the
    conversion's workers): aliases at the root and nested (their links listed again by
    another part), soft, external and dangling links, a dataset at the root, strings
    and attributes come out as one walk of the file gives them."""
    from zstore.convert import _scan

    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x/wav"] = np.zeros((2, 16000), np.float32)
    src = speech(tmp_path / "l.h5", [0.5, 1.0, 1.5, 2.0], scaled)
    with h5py.File(src, "a") as f:
        f["rec_alias"] = f["rec_001"]  # the same group at the root, in another part
        for k in range(3):
            f[f"spk/a/utt{k}/wav"] = np.ones((2, 1600 * (k + 1)), np.float32)
            f[f"spk/a/utt{k}"].attrs["k"] = k
        f["spk/b"] = f["spk/a"]  # a nested alias in the same part
        f["zz/again"] = f["spk/a"]  # and in a later part, whose walk lists its links
        f["zz/one"] = f["spk/a/utt1"]
        f["rec_soft/wav"] = h5py.SoftLink("/rec_000/wav")
        f["rec_soft/act"] = h5py.SoftLink("/rec_000/act")
        f["rec_soft_group"] = h5py.SoftLink("/rec_002")
        f["rec_ext"] = h5py.ExternalLink(str(other), "/x")
        f["rec_gone/wav"] = h5py.SoftLink("/nowhere")
        f["at_root"] = np.zeros(3)
        f["rec_003/text"] = "not numbers"
    one = _scan.scan(src)
    said = "\n".join(one[1])
    for alias in ("rec_alias", "spk/b", "zz/again", "zz/one", "rec_soft_group"):
        assert f"{alias}: the same group as" in said, said
    monkeypatch.setattr(_scan, "SHARED_BYTES", 0)
    monkeypatch.setattr(_scan, "SHARED_TASKS", 1000)  # a task per root-level link
    assert _scan.scan(src, _Inline()) == one
    with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as pool:
        assert _scan.scan(src, pool) == one  # rows pickled back from other processes
    with pytest.raises(zstore.SourceError, match="changed while it was being scanned"):
        _scan.walk_part(src, (1, 2, 3), [(b"rec_000", h5py.h5l.TYPE_HARD)])


def test_string_datasets_are_kept_as_attributes_and_the_rest_said_once_per_kind(tmp_path):
    """Speech corpora keep a transcript (a string dataset) in each utterance's group: it
    is kept as an attribute of the item (``ds.item_attrs``), packed or not; a list of
    words too.  What is left out (strings that are no list, strings in a group that is
    no item) is said once per dataset name and reason, with how many groups and the
    first few, in the warning, the report, the manifest and ``zstore info``: one line
    per group gave 2 warnings and 2 report lines per item, and a root header that grew
    with the corpus (read by every process that opens the store)."""
    seconds = [0.5 + 0.01 * i for i in range(299)] + [30.0]  # the last one unpacked

    def strings(g, i):
        g["text"] = f"transcript {i} — ünï"
        g["words"] = np.array([b"a", b"bc"])
        g["grid"] = np.array([[b"a", b"b"], [b"c", b"d"]])  # no list: left out
        if i == 7:
            g["note"] = "only here"

    src = speech(tmp_path / "t.h5", seconds, strings)
    with h5py.File(src, "a") as f:
        f["meta/corpus"] = "a group of strings only"
    with pytest.warns(UserWarning) as said:
        report = zstore.convert(
            src, tmp_path / "t.zarr", rates={"wav": 16000}, workers=1, progress=False
        )
    warned = [str(w.message) for w in said if "skipping" in str(w.message)]
    assert len(warned) == 2, warned
    grid = next(w for w in warned if "grid: strings (|S1), more than one list" in w)
    assert "in 300 groups (rec_000, rec_001, rec_002 and 297 more)" in grid
    assert any("meta/corpus: strings (object) in a group that is not an item" in w for w in warned)
    assert len(report.skipped) == 2 and len(str(report).splitlines()) < 20
    assert report.texts == {"text": 300, "words": 300, "note": 1}
    assert "note, text, words: strings, kept as attributes of their items (300" in str(report)
    assert report.packed == 299
    manifest = manifest_of(tmp_path / "t.zarr")
    assert manifest.extra["skipped"] == report.skipped
    assert (tmp_path / "t.zarr" / "zarr.json").stat().st_size < 8192
    info = cli("info", str(tmp_path / "t.zarr")).stdout
    assert "grid: strings (|S1), more than one list of 4096" in info
    ds = zstore.WindowDataset(tmp_path / "t.zarr", window_seconds=None, cache=False)
    assert len(ds) == 300
    for i in (0, 7, 299):
        attrs = ds.item_attrs(f"rec_{i:03d}")
        assert attrs["text"] == f"transcript {i} — ünï" and attrs["words"] == ["a", "bc"]
        assert ("note" in attrs) is (i == 7) and "grid" not in attrs


def test_what_is_left_out_is_said_in_at_most_a_hundred_lines(tmp_path):
    """Many reasons of their own (here dangling soft links, one per group) are listed up
    to a hundred lines, then counted."""

    def dangling(g, i):
        g[f"ref_{i}"] = h5py.SoftLink(f"/nowhere/{i}")

    src = speech(tmp_path / "d.h5", [0.5] * 150, dangling)
    with pytest.warns(UserWarning) as said:
        report = zstore.convert(
            src, tmp_path / "d.zarr", rates={"wav": 16000}, workers=1, progress=False
        )
    assert len(report.skipped) == 100
    assert report.skipped[-1] == "... and 51 more left out"
    assert "rec_000/ref_0: soft link to /nowhere/0, which does not exist" in report.skipped
    warned = [str(w.message) for w in said if "skipping" in str(w.message)]
    assert len(warned) <= 11
    assert manifest_of(tmp_path / "d.zarr").extra["skipped"] == report.skipped


@pytest.mark.parametrize("pack_seconds", [0.0, 10.0])
def test_groups_written_in_either_byte_order_convert_as_one_array(tmp_path, pack_seconds):
    """Files written on other machines or by other tools hold big-endian datasets beside
    little-endian ones; the store holds little-endian values either way (an array whose
    groups differed in byte order only was refused as two dtypes).  Appending a
    big-endian file keeps the store's dtype."""
    rng = np.random.default_rng(11)

    def write(path: Path, orders: str, tag: str) -> str:
        groups = {}
        for i, order in enumerate(orders):
            n = 16000 * (2 + i)
            groups[f"{tag}{i}"] = {
                "wav": (rng.integers(-3000, 3000, (2, n)) / 32768).astype(f"{order}f4"),
                "lab": rng.integers(0, 5, n // 160).astype(f"{order}i4"),
            }
        return write_h5(path, groups)

    first, more = write(tmp_path / "a.h5", "<><", "a"), write(tmp_path / "b.h5", ">>", "b")
    store = tmp_path / "s.zarr"
    rates = {"wav": 16000, "lab": 100}
    zstore.convert(
        first,
        store,
        rates=rates,
        verify=True,
        workers=1,
        progress=False,
        pack_seconds=pack_seconds,
    )
    zstore.append(more, store, verify=True, workers=1, progress=False)
    ds = zstore.WindowDataset(store, window_seconds=None, cache=False)
    assert len(ds) == 5
    for i in range(len(ds)):
        got = ds[i]
        with h5py.File(first if got["item"].startswith("a") else more) as f:
            for name in ("wav", "lab"):
                np.testing.assert_array_equal(got[name].numpy(), f[got["item"]][name][()])
    assert ds[0]["wav"].numpy().dtype == np.float32


def test_an_array_of_two_dtypes_or_ranks_is_refused_naming_both_groups(tmp_path):
    def write(path: Path, second) -> str:
        return write_h5(
            path, {"r0": {"wav": np.zeros((2, 16000), np.float32)}, "r1": {"wav": second}}
        )

    wider = write(tmp_path / "d.h5", np.zeros((2, 16000), np.float64))
    with pytest.raises(zstore.SourceError, match=r"'r1/wav' is float64 but 'r0/wav' is float32"):
        zstore.convert(wider, tmp_path / "d.zarr", rates={"wav": 16000}, progress=False)
    flat = write(tmp_path / "n.h5", np.zeros(16000, np.float32))
    with pytest.raises(zstore.SourceError, match=r"'r1/wav' has 1 dimensions .* 'r0/wav' has 2"):
        zstore.convert(flat, tmp_path / "n.zarr", rates={"wav": 16000}, progress=False)
    assert not (tmp_path / "d.zarr").exists() and not (tmp_path / "n.zarr").exists()


def test_groups_with_no_time_array_are_left_out_of_the_windows(tmp_path):
    """A speaker's group holds its embedding, its utterances' groups below it hold the
    audio: every group with datasets is an item, and the speakers' have no time array.
    Windows are cut from the items that have one, with a warning naming the others (the
    default fields were 'the time arrays every item has': none, and the error said
    "no array(s) [] in the store")."""
    rng = np.random.default_rng(2)
    groups: dict[str, dict[str, np.ndarray]] = {}
    for s in range(3):
        groups[f"spk{s}"] = {"xvector": rng.standard_normal(192).astype(np.float32)}
        for u in range(4):
            wav = rng.integers(-3000, 3000, (1, 16000 * (11 + u))) / 32768
            groups[f"spk{s}/utt{u}"] = {"wav": wav.astype(np.float32)}
    src = write_h5(tmp_path / "n.h5", groups)
    store = tmp_path / "n.zarr"
    report = zstore.convert(src, store, rates={"wav": 16000}, workers=1, progress=False)
    assert "no time axis proven (never in the same item as 'wav')" in str(report)
    assert len(manifest_of(store).items) == 15
    with pytest.warns(UserWarning, match=r"3 of 15 item\(s\) have no time array.*'spk0'"):
        ds = zstore.WindowDataset(store, window_seconds=2.0, windows_per_item=2, cache=False)
    assert len(ds) == 24 and not ds.short_items
    with h5py.File(src) as f:
        for i in range(len(ds)):
            got = ds[i]
            start = int(round(got["start"] * 16000))
            want = f[got["item"]]["wav"][:, start : start + 32000]
            np.testing.assert_array_equal(got["wav"].numpy(), want)
    whole = zstore.WindowDataset(
        store, window_seconds=None, fields=["xvector"], missing="skip", cache=False
    )
    assert len(whole) == 3 and whole[0]["xvector"].shape == (192,)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the speakers' groups were not asked for
        items = zstore.WindowDataset(store, window_seconds=2.0, items=["spk1/utt2"], cache=False)
    assert len(items) == 1 and items[0]["item"] == "spk1/utt2"
    with pytest.warns(UserWarning, match=r"1 of 15 item\(s\) have no time array.*'spk2'"):
        asked = zstore.WindowDataset(
            store, window_seconds=2.0, items=["spk2", "spk2/utt0"], cache=False
        )
    assert len(asked) == 1


def test_no_time_array_in_every_recording_says_which_are_where(tmp_path):
    """Half the groups hold only 'wav', half only 'act': no default field serves every
    item, and the error says where each time array is and what to pass."""
    src = write_h5(
        tmp_path / "h.h5",
        {
            f"r{i}": {"wav": np.zeros((1, 48000), np.float32)}
            if i % 2
            else {"act": np.zeros((1, 300), np.float32)}
            for i in range(4)
        },
    )
    store = tmp_path / "h.zarr"
    zstore.convert(src, store, rates={"wav": 16000, "act": 100}, workers=1, progress=False)
    with pytest.raises(zstore.ConfigError) as e:
        zstore.WindowDataset(store, window_seconds=1.0, cache=False)
    said = str(e.value)
    assert "no time array is in every item" in said
    assert "'act' in 2 of 4 items" in said and "'wav' in 2 of 4 items" in said
    assert "fields=['act'], missing='skip'" in said


def test_items_left_out_for_a_missing_field_are_not_called_short(tmp_path):
    """With missing='skip', items without a field asked for are left out before the
    window's length is checked: short='error' used to name them as shorter than the
    window (their length of the field they lack is 0)."""
    src = speech(
        tmp_path / "m.h5",
        [3.0, 4.0, 5.0],
        lambda g, i: (
            g.create_dataset("ref", data=np.zeros((1, g["wav"].shape[1]), np.float32))
            if i
            else None
        ),
    )
    store = tmp_path / "m.zarr"
    zstore.convert(src, store, rates={"wav": 16000, "ref": 16000}, workers=1, progress=False)
    with pytest.warns(UserWarning, match="'rec_000'"):
        ds = zstore.WindowDataset(
            store,
            window_seconds=2.0,
            fields=["wav", "ref"],
            missing="skip",
            short="error",
            cache=False,
        )
    assert len(ds) == 2 and {ds[0]["item"], ds[1]["item"]} == {"rec_001", "rec_002"}


def test_an_attribute_with_no_value_is_null(tmp_path):
    """``h5py.Empty`` (an HDF5 attribute with a type and no value, as MATLAB and some
    tools write) is null in the store's attributes and in what ``items=`` callables
    see; it was the string "Empty(dtype=dtype('<f4'))"."""
    src = speech(
        tmp_path / "e.h5", [1.0, 2.0], lambda g, i: g.attrs.create("gain", h5py.Empty("f"))
    )
    store = tmp_path / "e.zarr"
    zstore.convert(src, store, rates={"wav": 16000}, workers=1, progress=False, pack_seconds=0)
    assert zarr.open_group(store, mode="r")["rec_000"].attrs["gain"] is None
    seen = []
    zstore.WindowDataset(
        store, window_seconds=1.0, items=lambda n, a: seen.append(a["gain"]) or True, cache=False
    )
    assert seen == [None, None]


def test_what_appends_leave_out_stays_within_a_hundred_lines(tmp_path):
    """Each append adds what its file left out to the manifest; however many appends, the
    list keeps a hundred lines, the last counting the rest."""

    def source(k: int) -> str:
        src = speech(
            tmp_path / f"f{k}.h5",
            [0.5] * 60,
            lambda g, i: g.__setitem__(f"ref_{i}", h5py.SoftLink(f"/nowhere/{k}/{i}")),
        )
        with h5py.File(src, "a") as f:  # the files' items named apart
            for i in range(60):
                f.move(f"rec_{i:03d}", f"f{k}_{i:03d}")
        return src

    store = tmp_path / "s.zarr"
    with pytest.warns(UserWarning, match="skipping"):
        zstore.convert(source(0), store, rates={"wav": 16000}, workers=1, progress=False)
    for k in (1, 2):
        zstore.append(source(k), store, workers=1, progress=False)
    skipped = manifest_of(store).extra["skipped"]
    assert len(skipped) == 100 and skipped[-1] == "... and 81 more left out"
    assert "f0_000/ref_0: soft link to /nowhere/0/0, which does not exist" in skipped
    assert len(manifest_of(store).items) == 180


def frames_first(path: Path, lengths: list[int]) -> str:
    """Recordings of int16-valued audio, a bool ``act`` at 100/s and complex STFT frames
    stored frames first (``spec``: (frames, 3)), one group per length in samples."""
    rng = np.random.default_rng(11)
    items = {}
    for i, n in enumerate(lengths):
        frames = -(-n // 160)
        items[f"utt{i}"] = {
            "wav": (rng.integers(-3000, 3000, (2, n)) / 32768).astype(np.float32),
            "act": rng.random((2, frames)) > 0.5,
            "spec": (
                rng.standard_normal((frames, 3)) + 1j * rng.standard_normal((frames, 3))
            ).astype(np.complex64),
        }
    return write_h5(path, items)


@pytest.mark.parametrize("pack_seconds", [0.0, 10.0], ids=["own groups", "packed"])
def test_complex_and_bool_time_arrays_read_exact_through_the_tiers(tmp_path, cache, pack_seconds):
    src = frames_first(tmp_path / "a.h5", [16000 * s for s in (3, 4, 5, 6)])
    report = zstore.convert(
        src,
        tmp_path / "a.zarr",
        rates={"wav": 16000},
        time_axis={"spec": 0},
        pack_seconds=pack_seconds,
        verify=True,
        progress=False,
    )
    assert report.packed == (4 if pack_seconds else 0)  # complex values packed too
    rates, axes = {"wav": 16000, "act": 100, "spec": 100}, {"wav": 1, "act": 1, "spec": 0}
    with h5py.File(src) as f:
        for tiers in (None, cache, cache):  # the second finds the metadata in the tiers
            ds = zstore.WindowDataset(
                tmp_path / "a.zarr",
                window_seconds=2.0,
                fields=list(rates),
                windows_per_item=3,
                cache=tiers,
            )
            for epoch in (0, 1):
                ds.set_epoch(epoch)
                for i in range(len(ds)):
                    x = ds[i]
                    for name, rate in rates.items():
                        start = round(x["start"] * rate)
                        part = [slice(None)] * 2
                        part[axes[name]] = slice(start, start + round(2.0 * rate))
                        expected = f[x["item"]][name][tuple(part)]
                        assert x[name].dtype == torch_dtype(expected.dtype)
                        assert np.array_equal(x[name].numpy(), expected), (x["item"], name)


def torch_dtype(dtype: np.dtype):
    import torch

    return torch.from_numpy(np.zeros(1, dtype)).dtype


def test_a_rate_is_inferred_past_a_short_first_item_and_one_too_short_for_a_frame(tmp_path):
    # the first item's ceil-rounded length (161 samples: 2 frames) skewed the ratio, and
    # one of 100 samples, rounded down to no frame at all, refused it
    src = frames_first(tmp_path / "a.h5", [161, 16000 * 3, 16000 * 4, 16000 * 5 + 80])
    with h5py.File(src, "a") as f:
        del f["utt1/act"]
        f["utt1/act"] = np.zeros((2, 0), bool)
        del f["utt1/wav"]
        f["utt1/wav"] = np.zeros((2, 100), np.float32)
    report = zstore.convert(src, tmp_path / "a.zarr", rates={"wav": 16000}, progress=False)
    act = manifest_of(tmp_path / "a.zarr").arrays["act"]
    assert (act.rate, act.inferred) == (100.0, True), report


def test_frames_first_features_are_named_with_the_time_axis_to_give(tmp_path):
    src = frames_first(tmp_path / "a.h5", [16000 * s for s in (3, 4, 5)])
    zstore.convert(src, tmp_path / "a.zarr", rates={"wav": 16000}, progress=False)
    spec = manifest_of(tmp_path / "a.zarr").arrays["spec"]
    assert spec.rate is None
    assert "along axis 0 it is 1/160 of the length of 'wav'" in spec.note
    assert "--time-axis spec=0" in spec.note


def test_one_item_off_the_ratio_is_named_where_a_rate_is_not_inferred(tmp_path):
    # one group's act does not match its wav (a truncated or mislinked dataset): the
    # rate is not inferred, and the report says which item breaks the ratio
    src = frames_first(tmp_path / "a.h5", [16000 * s for s in (3, 4, 5, 6)])
    with h5py.File(src, "a") as f:
        del f["utt2/act"]
        f["utt2/act"] = np.zeros((2, 1100), bool)  # 11 s of frames beside 5 s of samples
    zstore.convert(src, tmp_path / "a.zarr", rates={"wav": 16000}, progress=False)
    act = manifest_of(tmp_path / "a.zarr").arrays["act"]
    assert act.rate is None
    assert "1/160 of it in 3 of 4 items, not in 'utt2' (1100 against 80000)" in act.note
    assert "give --rate act=100" in act.note
    with pytest.raises(zstore.SourceError, match="group 'utt2': 'act' lasts 11.000 s"):
        zstore.convert(src, tmp_path / "b.zarr", rates={"wav": 16000, "act": 100}, progress=False)


def test_the_rate_example_names_the_audio_not_a_dimension_scale_as_long(tmp_path):
    src = frames_first(tmp_path / "a.h5", [16000 * s for s in (3, 4)])
    with h5py.File(src, "a") as f:
        g = f["utt1"]
        g["time"] = np.arange(g["wav"].shape[1]) / 16000  # as long as wav, one item only
        g["time"].make_scale("time")
        g["wav"].dims[1].attach_scale(g["time"])
    with pytest.raises(zstore.SourceError, match=r"e\.g\. --rate wav=16000 \(arrays of 'utt1'"):
        zstore.convert(src, tmp_path / "a.zarr", progress=False)


def test_info_shows_arrays_written_through_zarr_and_skips_empty_first_items(tmp_path):
    src = frames_first(tmp_path / "a.h5", [16000 * s for s in (3, 4, 5)])
    with h5py.File(src, "a") as f:  # an empty recording first, as failed segments come
        g = f.create_group("a_empty")
        g["wav"], g["act"] = np.zeros((2, 0), np.float32), np.zeros((2, 0), bool)
        g["spec"] = np.zeros((0, 3), np.complex64)
    zstore.convert(
        src, tmp_path / "a.zarr", rates={"wav": 16000}, time_axis={"spec": 0}, progress=False
    )
    assert manifest_of(tmp_path / "a.zarr").items[0] == "a_empty"
    info = json.loads(cli("info", str(tmp_path / "a.zarr"), "--json").stdout)["arrays"]
    assert info["spec"]["dtype"] == "complex64"
    assert info["spec"]["shape_of_first_item"] == [300, 3]
    assert info["wav"]["shape_of_first_item"] == [2, 48000]
    assert info["wav"]["shown_item"] == "utt0"
    text = cli("info", str(tmp_path / "a.zarr")).stdout
    assert "spec: 100/s (inferred), complex64, item 'utt0' (the first with values) [300, 3]" in text


@pytest.mark.parametrize("pack_seconds", [0.0, 10.0], ids=["own groups", "packed"])
def test_scalar_and_embedding_datasets_come_whole_next_to_the_windows(
    tmp_path, cache, pack_seconds
):
    # a scalar label and an embedding in every recording's group, as corpora keep them
    rng = np.random.default_rng(3)
    items = {
        f"r{i}": {
            "wav": (rng.integers(-3000, 3000, (1, 16000 * (2 + i))) / 32768).astype(np.float32),
            "label": np.int64(i % 3),
            "emb": rng.standard_normal(8).astype(np.float32),
        }
        for i in range(6)
    }
    src = write_h5(tmp_path / "a.h5", items)
    report = zstore.convert(
        src, tmp_path / "a.zarr", rates={"wav": 16000}, progress=False, pack_seconds=pack_seconds
    )
    assert report.packed == (6 if pack_seconds else 0)
    # 32 bytes an item: no lossy precision is worth suggesting for it
    assert report.values["emb"].startswith("true float32 values, stored lossless")
    assert "--precision" not in report.values["emb"]
    fields = ["wav", "label", "emb"]
    for tiers in (None, cache, cache):
        for seconds in (1.0, None):
            ds = zstore.WindowDataset(
                tmp_path / "a.zarr", window_seconds=seconds, fields=fields, cache=tiers
            )
            for i in range(len(ds)):
                x = ds[i]
                assert x["label"].shape == () and int(x["label"]) == int(x["item"][1:]) % 3
                assert np.array_equal(x["emb"].numpy(), items[x["item"]]["emb"])
        ds = zstore.WindowDataset(
            tmp_path / "a.zarr", window_seconds=1.0, fields=fields, cache=tiers
        )
        batches = list(zstore.WindowLoader(ds, batch_size=4, shuffle=True))
        assert sum(len(b["item"]) for b in batches) == len(ds)
        for b in batches:
            assert b["label"].shape == (len(b["item"]),) and b["emb"].shape == (len(b["item"]), 8)
            for j, item in enumerate(b["item"]):
                assert int(b["label"][j]) == items[item]["label"]
                assert np.array_equal(b["emb"][j].numpy(), items[item]["emb"])


def test_a_scalar_is_read_through_zarr_once_per_process_and_never_shared(tmp_path, monkeypatch):
    # a scalar label is not an array the reader decodes itself: zarr read it for every
    # window (~1 ms each, 7x fewer windows/s); it is kept once read
    items = {
        f"r{i}": {
            "wav": np.zeros((1, 16000 * (2 + i)), np.float32),
            "label": np.int64(10 + i),
        }
        for i in range(3)
    }
    src = write_h5(tmp_path / "a.h5", items)
    zstore.convert(src, tmp_path / "a.zarr", rates={"wav": 16000}, progress=False, pack_seconds=0)
    ds = zstore.WindowDataset(tmp_path / "a.zarr", window_seconds=1.0, fields=["wav", "label"])
    first = [int(ds[i]["label"]) for i in range(len(ds))]
    ds[0]["label"].fill_(-1)  # what a caller does with its tensor stays its own

    def no_zarr(*args, **kwargs):
        raise AssertionError("read through zarr again")

    monkeypatch.setattr(zarr, "open_group", no_zarr)
    ds.reader._group = None
    assert [int(ds[i]["label"]) for i in range(len(ds))] == first == [10, 11, 12]


SEGMENT = np.dtype([("start", "<f8"), ("end", "<f8"), ("speaker", "<i4")])
FRAME = np.dtype([("pitch", "<f4"), ("energy", "<f4")])


def diarization(path: Path) -> str:
    """Recordings with a segment table (1-2 rows of start, end, speaker) and per-frame
    records (pitch, energy at 100/s) as compound datasets, as alignment tools write."""
    rng = np.random.default_rng(9)
    with h5py.File(path, "w") as f:
        for i in range(4):
            g = f.create_group(f"rec{i}")
            n = 16000 * (3 + i)
            g["wav"] = (rng.integers(-3000, 3000, (1, n)) / 32768).astype(np.float32)
            rows = [(0.0, 1.0, 0), (1.0, 2.5, 1 + i)][: 1 + i % 2]
            g["segments"] = np.array(rows, dtype=SEGMENT)
            g["segments"].attrs["unit"] = "s"
            frames = np.zeros(n // 160, dtype=FRAME)
            frames["pitch"], frames["energy"] = rng.random(n // 160), rng.random(n // 160)
            g["frames"] = frames
    return str(path)


@pytest.mark.parametrize("pack_seconds", [0.0, 10.0], ids=["own groups", "packed"])
def test_compound_datasets_are_converted_one_array_per_field(tmp_path, pack_seconds):
    src = diarization(tmp_path / "d.h5")
    store = tmp_path / "d.zarr"
    # 1-2 segment rows in recordings of 3-6 s fitted 16000 / 48000 rounded, and the
    # conversion stopped: "--rate segments.end=0.333333 ... less than one sample"
    report = zstore.convert(
        src, store, rates={"wav": 16000}, progress=False, pack_seconds=pack_seconds, verify=True
    )
    arrays = manifest_of(store).arrays
    assert arrays["frames.pitch"].rate == 100 and arrays["frames.energy"].inferred
    for name in ("segments.start", "segments.end", "segments.speaker"):
        assert arrays[name].rate is None, report
    assert not any("segments" in s or "frames" in s for s in report.skipped)
    tables = ["segments.start", "segments.end", "segments.speaker"]
    with h5py.File(src) as f:
        ds = zstore.WindowDataset(
            store, window_seconds=None, fields=["wav", "frames.pitch", "frames.energy", *tables]
        )
        for i in range(len(ds)):
            x = ds[i]
            for name in ("frames.pitch", "frames.energy", *tables):
                dataset, field = name.split(".")
                want = f[x["item"]][dataset][field]
                assert x[name].numpy().dtype == want.dtype
                np.testing.assert_array_equal(x[name].numpy(), want)
        windows = zstore.WindowDataset(store, window_seconds=1.0, fields=["wav", "frames.pitch"])
        for i in range(len(windows)):
            x = windows[i]
            start = round(x["start"] * 100)
            want = f[x["item"]]["frames"]["pitch"][start : start + 100]
            np.testing.assert_array_equal(x["frames.pitch"].numpy(), want)
    if not pack_seconds:  # the table's attributes go with each of its fields
        assert zarr.open_group(store, mode="r")["rec0/segments.end"].attrs["unit"] == "s"


def test_a_compound_field_named_as_another_dataset_is_left_out_and_said(tmp_path):
    src = diarization(tmp_path / "d.h5")
    with h5py.File(src, "a") as f:
        for i in range(4):
            f[f"rec{i}/segments.end"] = np.zeros(3, np.float32)
    with pytest.warns(UserWarning, match="segments"):
        report = zstore.convert(src, tmp_path / "d.zarr", rates={"wav": 16000}, progress=False)
    said = [s for s in report.skipped if "compound" in s]
    assert said and "'segments.end', the name of another dataset" in said[0]
    arrays = manifest_of(tmp_path / "d.zarr").arrays
    assert "segments.end" in arrays and "segments.start" not in arrays


@pytest.mark.parametrize("pack_seconds", [0.0, 10.0], ids=["own groups", "packed"])
def test_nan_and_inf_values_are_stored_and_named(tmp_path, pack_seconds):
    # processed float audio with a few NaN (a division by zero upstream) in two items
    rng = np.random.default_rng(5)
    items = {}
    for i, seconds in enumerate((3, 4, 5, 6)):
        wav = (rng.standard_normal((1, 16000 * seconds)) * 0.1).astype(np.float32)
        if i in (1, 3):
            wav[0, 100:103] = np.nan
            wav[0, 500] = -np.inf
        spec = np.ones((seconds * 100, 2), np.complex64)
        if i == 2:
            spec[7, 1] = complex(np.inf, 0)
        items[f"utt{i}"] = {"wav": wav, "spec": spec}
    src = write_h5(tmp_path / "a.h5", items)
    with pytest.warns(UserWarning) as caught:
        report = zstore.convert(
            src,
            tmp_path / "a.zarr",
            rates={"wav": 16000},
            time_axis={"spec": 0},
            pack_seconds=pack_seconds,
            progress=False,
        )
    said = [str(w.message) for w in caught]
    assert any(
        "'wav' holds 8 NaN or infinite value(s) in 2 item(s) ('utt1', 'utt3')" in m for m in said
    ), said
    assert any("'spec' holds 1 NaN or infinite value(s) in 1 item(s) ('utt2')" in m for m in said)
    assert "8 NaN or infinite value(s) in 2 item(s)" in report.values["wav"]
    ds = zstore.WindowDataset(
        tmp_path / "a.zarr", window_seconds=None, fields=["wav", "spec"], cache=False
    )
    for i in range(len(ds)):
        x = ds[i]
        want = items[x["item"]]
        np.testing.assert_array_equal(x["wav"].numpy(), want["wav"])  # NaN where they were
        np.testing.assert_array_equal(x["spec"].numpy(), want["spec"])


def _plugin_compressed(path: Path) -> dict:
    """Recordings compressed with filters h5py lacks (hdf5plugin's Zstd and Blosc)."""
    hdf5plugin = pytest.importorskip("hdf5plugin")
    rng = np.random.default_rng(8)
    items = {}
    with h5py.File(path, "w") as f:
        for i in range(3):
            wav = (rng.integers(-3000, 3000, (2, 16000 * (2 + i))) / 32768).astype(np.float32)
            act = rng.random((2, 100 * (2 + i))) > 0.5
            f.create_dataset(f"u{i}/wav", data=wav, chunks=(2, 16000), **hdf5plugin.Zstd())
            f.create_dataset(f"u{i}/act", data=act, chunks=(2, 100), **hdf5plugin.Blosc())
            items[f"u{i}"] = {"wav": wav, "act": act}
    return items


def test_datasets_compressed_with_hdf5plugin_filters_convert(tmp_path):
    items = _plugin_compressed(tmp_path / "z.h5")
    zstore.convert(
        tmp_path / "z.h5", tmp_path / "z.zarr", rates={"wav": 16000}, verify=True, progress=False
    )
    ds = zstore.WindowDataset(tmp_path / "z.zarr", window_seconds=None, cache=False)
    for i in range(len(ds)):
        x = ds[i]
        np.testing.assert_array_equal(x["wav"].numpy(), items[x["item"]]["wav"])


def test_a_filter_h5py_lacks_is_named_not_taken_for_corruption(tmp_path):
    _plugin_compressed(tmp_path / "z.h5")
    code = (  # a Python without hdf5plugin
        "import sys; sys.modules['hdf5plugin'] = None\n"
        "import zstore\n"
        f"zstore.convert({str(tmp_path / 'z.h5')!r}, {str(tmp_path / 'z.zarr')!r}, "
        "rates={'wav': 16000}, workers=1, progress=False)\n"
    )
    proc = subprocess.run(
        [PYTHON, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    assert "is compressed with the HDF5 filter" in proc.stderr, proc.stderr[-2000:]
    assert "pip install hdf5plugin" in proc.stderr and "corrupt" not in proc.stderr


def test_framed_features_that_lose_frames_at_the_edges_take_their_rate(tmp_path):
    """Kaldi-style features (``snip_edges``: 1 + (N - 400) // 160 frames of 25 ms every
    10 ms, as torchaudio.compliance.kaldi.fbank gives) are 1.5-2.5 frames shorter than
    the audio; features computed centred are one frame longer. Both take their rate,
    and windows stay within what every array covers, aligned by their starts."""
    rng = np.random.default_rng(4)
    items = {}
    for i, n in enumerate(int(s * 16000) + int(rng.integers(0, 160)) for s in (3, 4, 5)):
        items[f"u{i}"] = {
            "wav": (rng.integers(-3000, 3000, (1, n)) / 32768).astype(np.float32),
            "fbank": rng.standard_normal((1 + (n - 400) // 160, 80)).astype(np.float32),
            "mel": rng.standard_normal((80, 1 + n // 160)).astype(np.float32),
        }
    src = write_h5(tmp_path / "k.h5", items)
    dst = tmp_path / "k.zarr"
    zstore.convert(
        src, dst, rates={"wav": 16000, "fbank": 100, "mel": 100}, time_axis={"fbank": 0},
        workers=1, progress=False,
    )  # fmt: skip
    ds = zstore.WindowDataset(dst, window_seconds=1.0, fields=["wav", "fbank", "mel"], cache=False)
    for epoch in range(4):
        ds.set_epoch(epoch)
        for i in range(len(ds)):
            x = ds[i]
            want, s = items[x["item"]], float(x["start"])
            a, f = round(s * 16000), round(s * 100)
            assert np.array_equal(x["wav"].numpy(), want["wav"][:, a : a + 16000])
            assert np.array_equal(x["fbank"].numpy(), want["fbank"][f : f + 100])
            assert np.array_equal(x["mel"].numpy(), want["mel"][:, f : f + 100])
    # a rate that is wrong by more than the edges' frames is still refused
    with pytest.raises(zstore.SourceError, match="'fbank' lasts .* at 120/s"):
        zstore.convert(
            src, tmp_path / "w.zarr", rates={"wav": 16000, "fbank": 120},
            time_axis={"fbank": 0}, workers=1, progress=False,
        )  # fmt: skip


def test_items_whose_rate_attribute_contradicts_the_rate_are_refused_by_name(tmp_path):
    """A corpus mixing 8 kHz and 16 kHz recordings, each saying its rate in an
    attribute: with --rate wav=16000 the 8 kHz items would give windows of twice the
    time asked, and nothing else in them contradicts it."""
    rng = np.random.default_rng(5)
    src = tmp_path / "mixed.h5"
    with h5py.File(src, "w") as f:
        for i in range(5):
            sr = 8000 if i in (1, 3) else 16000
            g = f.create_group(f"u{i}")
            g.attrs["sr"] = 16.0 if i == 4 else sr  # in kHz, as some corpora keep it
            g["wav"] = (rng.integers(-3000, 3000, (1, int(3.5 * sr) + 40 * i)) / 32768).astype("f4")
            g["act"] = np.zeros((2, 350 + i), bool)
            g["act"].attrs["frame_rate"] = 100
    dst = tmp_path / "m.zarr"
    proc = cli("convert", str(src), str(dst), "--rate", "wav=16000", "--rate", "act=none")
    assert_one_line_error(proc, "2 item(s) state a rate", "'u1': its group has sr=8000", "'u3'")
    assert not dst.exists()
    # the 16 kHz items alone: their attributes agree (the group's with wav, act's own)
    report = zstore.convert(
        src, dst, rates={"wav": 16000, "act": 100}, exclude=["u1", "u3"], workers=1, progress=False
    )
    assert report.items == 3 and manifest_of(dst).arrays["act"].rate == 100
    # the dataset's own attribute is checked against its array's rate
    with h5py.File(src, "a") as f:
        f["u0/act"].attrs["frame_rate"] = 50
    with pytest.raises(
        zstore.SourceError, match="'u0': its 'act' has frame_rate=50, but 'act' is at 100/s"
    ):
        zstore.convert(
            src, tmp_path / "n.zarr", rates={"wav": 16000, "act": 100}, exclude=["u1", "u3"]
        )
    # the 8 kHz items alone, at their rate
    eight = zstore.convert(
        src, tmp_path / "8k.zarr", rates={"wav": 8000, "act": None}, include=["u1", "u3"],
        workers=1, progress=False,
    )  # fmt: skip
    assert eight.items == 2


def _matlab_v73(path, rates: list[int]) -> dict[str, np.ndarray]:
    """A MATLAB ``save('-v7.3')`` file as MATLAB writes it: a 512-byte user block, one
    struct per recording (``rec.wav``, samples x mics as HDF5 sees MATLAB's column-major
    mics x samples; ``rec.fs`` a 1x1 double), and the ``#refs#`` group of referenced
    data."""
    rng = np.random.default_rng(6)
    wavs = {}
    with h5py.File(path, "w", userblock_size=512) as f:
        for i, fs in enumerate(rates):
            g = f.create_group(f"rec{i}")
            g.attrs["MATLAB_class"] = np.bytes_("struct")
            wavs[f"rec{i}"] = wav = rng.integers(-3000, 3000, (int((2 + i) * fs), 2)) / 32768
            g.create_dataset("wav", data=wav).attrs["MATLAB_class"] = np.bytes_("double")
            g.create_dataset("fs", data=np.array([[fs]], "f8"))
        f["#refs#/a"] = np.zeros((3, 1))
    with open(path, "r+b") as raw:
        raw.write(b"MATLAB 7.3 MAT-file, Platform: GLNXA64, HDF5 schema 1.00 .")
    return wavs


def test_matlab_v73_files_convert_and_their_fs_is_checked(tmp_path):
    wavs = _matlab_v73(tmp_path / "rec.mat", [16000, 16000, 8000])
    dst = tmp_path / "m.zarr"
    options = dict(rates={"wav": 16000}, time_axis={"wav": 0}, dtypes={"wav": "float32"})
    with pytest.raises(zstore.SourceError, match="'rec2': its dataset 'fs' is 8000"):
        zstore.convert(tmp_path / "rec.mat", dst, workers=1, progress=False, **options)
    with pytest.warns(UserWarning, match="#refs#: MATLAB's store"):
        report = zstore.convert(
            tmp_path / "rec.mat", dst, workers=1, progress=False, exclude=["rec2"], **options
        )
    assert report.items == 2 and "#refs#" not in manifest_of(dst).items
    ds = zstore.WindowDataset(dst, window_seconds=1.0, fields=["wav"], cache=False)
    for i in range(len(ds)):
        x = ds[i]
        a = round(float(x["start"]) * 16000)
        want = wavs[x["item"]][a : a + 16000].astype(np.float32)
        assert np.array_equal(x["wav"].numpy(), want)


def _matlab_char(group, name: str, rows: list[str]) -> None:
    """A MATLAB char array as ``save('-v7.3')`` writes it: UTF-16 codes of the rows,
    padded with blanks, MATLAB's (rows, columns) stored as (columns, rows)."""
    width = max(len(r) for r in rows)
    codes = np.array([[ord(c) for c in r.ljust(width)] for r in rows], dtype=np.uint16)
    d = group.create_dataset(name, data=codes.T)
    d.attrs["MATLAB_class"] = np.bytes_("char")
    d.attrs["MATLAB_int_decode"] = np.int32(2)


@pytest.mark.parametrize("pack_seconds", [0.0, 10.0], ids=["own groups", "packed"])
def test_matlab_char_arrays_are_kept_as_text_attributes(tmp_path, pack_seconds):
    """A label or transcript in a MATLAB struct (``rec.label = 'walking'``) is a char
    array: uint16 codes marked ``MATLAB_class="char"``.  It is an attribute of its item,
    a string (a list of the rows of a char matrix); a uint16 array of MATLAB's own
    class ``uint16`` stays an array."""
    src = tmp_path / "act.mat"
    labels = ["walking é", "running", "sitting down"]
    with h5py.File(src, "w", userblock_size=512) as f:
        for i, label in enumerate(labels):
            g = f.create_group(f"rec{i}")
            g.attrs["MATLAB_class"] = np.bytes_("struct")
            acc = np.arange(3 * 1000 * (2 + i), dtype="f8").reshape(-1, 3) / 7
            g.create_dataset("acc", data=acc).attrs["MATLAB_class"] = np.bytes_("double")
            _matlab_char(g, "label", [label])
            _matlab_char(g, "words", label.split())
            counts = g.create_dataset("counts", data=np.arange(6, dtype=np.uint16).reshape(2, 3))
            counts.attrs["MATLAB_class"] = np.bytes_("uint16")
    dst = tmp_path / "m.zarr"
    report = zstore.convert(
        src,
        dst,
        rates={"acc": 1000},
        time_axis={"acc": 0},
        pack_seconds=pack_seconds,
        workers=1,
        progress=False,
        verify=True,
    )
    assert report.packed == (3 if pack_seconds else 0)
    assert "label, words: strings, kept as attributes" in str(report)
    ds = zstore.WindowDataset(dst, window_seconds=1.0, attrs=["label", "words"], cache=False)
    for i in range(len(ds)):
        x = ds[i]
        want = labels[int(x["item"][-1])]
        # a char matrix of one row is a string, as MATLAB's own 1 x n char is
        words = want.split() if " " in want else want
        assert x["label"] == want and x["words"] == words
        assert ds.item_attrs(i) == {"MATLAB_class": "struct", "label": want, "words": words}
    whole = zstore.WindowDataset(dst, window_seconds=None, fields=["counts"], cache=False)
    assert np.array_equal(whole[0]["counts"].numpy(), np.arange(6).reshape(2, 3))


def test_a_matlab_file_before_version_73_is_named_as_such(tmp_path):
    head = b"MATLAB 5.0 MAT-file, Platform: GLNXA64".ljust(116) + bytes(8) + b"\x00\x01IM"
    (tmp_path / "old.mat").write_bytes(head + bytes(64))
    proc = cli(
        "convert", str(tmp_path / "old.mat"), str(tmp_path / "o.zarr"), "--rate", "wav=16000"
    )
    assert_one_line_error(proc, "old.mat: a MATLAB .mat file of version 5-7", "-v7.3")


def test_a_source_another_process_writes_is_named_as_such(tmp_path):
    src = write_h5(tmp_path / "w.h5", {"u0": {"wav": np.zeros((1, 32000), np.float32)}})
    with h5py.File(src, "a"):  # a writer holding HDF5's file lock
        proc = cli("convert", src, str(tmp_path / "w.zarr"), "--rate", "wav=16000")
    assert_one_line_error(proc, "another process has the file open for writing")
    assert "corrupt" not in proc.stderr


def _virtual_corpus(where: Path) -> tuple[str, str]:
    """A file whose ``rec_000/wav`` is a virtual dataset over two source files (one
    second each, end to end) and whose ``rec_001/wav`` keeps its bytes in an external
    file beside it, as HDF5 tools write them (names relative to the file)."""
    rng = np.random.default_rng(3)
    for k in range(2):  # each a recording file of its own too
        with h5py.File(where / f"part{k}.h5", "w") as f:
            f[f"seg{k}/wav"] = (rng.integers(-3000, 3000, (2, 16000)) / 32768).astype(np.float32)
    layout = h5py.VirtualLayout(shape=(2, 32000), dtype=np.float32)
    for k in range(2):
        layout[:, k * 16000 : (k + 1) * 16000] = h5py.VirtualSource(
            f"part{k}.h5", f"seg{k}/wav", shape=(2, 16000)
        )
    (rng.standard_normal((2, 24000)).astype(np.float32) * 0.1).tofile(where / "raw.bin")
    src = where / "v.h5"
    with h5py.File(src, "w") as f:
        f.create_group("rec_000").create_virtual_dataset("wav", layout, fillvalue=0)
        f["rec_000/act"] = np.ones((2, 320), np.float32)
        f.create_group("rec_001").create_dataset(
            "wav", shape=(2, 24000), dtype=np.float32, external=[("raw.bin", 0, 2 * 24000 * 4)]
        )
        f["rec_001/act"] = np.zeros((2, 240), np.float32)
    return str(src), str(where / "v.zarr")


def test_virtual_and_external_datasets_convert_with_their_values(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # HDF5 finds external files from the working directory
    src, dst = _virtual_corpus(tmp_path)
    zstore.convert(src, dst, rates={"wav": 16000}, workers=1, progress=False, verify=True)
    ds = zstore.WindowDataset(dst, window_seconds=None, cache=False)
    with h5py.File(src) as f:
        for i in range(len(ds)):
            item = ds[i]["item"]
            assert np.array_equal(ds[i]["wav"].numpy(), f[f"{item}/wav"][()]), item


def test_a_virtual_dataset_whose_source_is_missing_is_left_out_not_read_as_zeros(
    tmp_path, monkeypatch
):
    # HDF5 reads a virtual dataset's missing source as its fill value, with no error
    monkeypatch.chdir(tmp_path)
    src, dst = _virtual_corpus(tmp_path)
    (tmp_path / "part1.h5").rename(tmp_path / "elsewhere.h5")
    with h5py.File(src) as f:
        assert not f["rec_000/wav"][:, 16000:].any()  # what would have been converted
    with pytest.warns(UserWarning, match="part1.h5 is missing"):
        zstore.convert(src, dst, rates={"wav": 16000}, workers=1, progress=False)
    manifest = manifest_of(dst)
    said = "\n".join(manifest.extra["skipped"])
    assert "rec_000/wav: a virtual dataset whose source file part1.h5 is missing" in said
    assert "zarr.json" not in {p.name for p in (Path(dst) / "rec_000" / "wav").glob("*")}
    ds = zstore.WindowDataset(dst, window_seconds=None, cache=False, fields=["wav"], missing="skip")
    assert [ds[i]["item"] for i in range(len(ds))] == ["rec_001"]


@pytest.mark.parametrize("changed", ["part0.h5", "raw.bin"])
def test_a_file_a_dataset_reads_changed_while_converted_is_not_published(
    tmp_path, monkeypatch, changed
):
    # a virtual dataset's source file, or an external storage file
    import importlib

    monkeypatch.chdir(tmp_path)
    src, dst = _virtual_corpus(tmp_path)
    module = importlib.import_module("zstore.convert.pipeline")
    original = module.write_all

    def write_all(*args, **kwargs):  # a writer racing the conversion, in place
        out = original(*args, **kwargs)
        if changed == "raw.bin":
            with open(tmp_path / changed, "r+b") as f:
                f.write(b"\0" * 64)
        else:
            with h5py.File(tmp_path / changed, "r+") as f:
                f["seg0/wav"][...] = 0
        return out

    monkeypatch.setattr(module, "write_all", write_all)
    with pytest.raises(zstore.SourceError, match=f"{changed}: the file changed while its items"):
        zstore.convert(src, dst, rates={"wav": 16000}, workers=1, progress=False)
    monkeypatch.undo()
    with pytest.raises(zstore.ZstoreError, match="conversion has not finished"):
        zstore.WindowDataset(dst, window_seconds=1.0, cache=False)


def test_a_rerun_after_a_virtual_datasets_source_changed_is_another_conversion(
    tmp_path, monkeypatch
):
    # the HDF5 file itself is unchanged: its virtual dataset's values are not
    monkeypatch.chdir(tmp_path)
    src, dst = _virtual_corpus(tmp_path)
    kw = {"rates": {"wav": 16000}, "workers": 1, "progress": False}
    zstore.convert(src, dst, **kw)
    zstore.convert(src, dst, **kw)  # the same sources: nothing to do
    with h5py.File(tmp_path / "part0.h5", "r+") as f:
        f["seg0/wav"][...] = 0
    with pytest.raises(zstore.ZstoreError, match=r"part0.h5 changed since"):
        zstore.convert(src, dst, **kw)
    zstore.convert(src, dst, overwrite=True, **kw)
    ds = zstore.WindowDataset(dst, window_seconds=None, cache=False)
    assert not ds[0]["wav"].numpy()[:, :16000].any()  # the values now in part0.h5


def _base_and_virtual(where: Path) -> tuple[str, str]:
    """:func:`_virtual_corpus`'s file, and a store of another file's item to append it to."""
    src, dst = _virtual_corpus(where)
    wav = np.zeros((2, 32000), np.float32)
    other = write_h5(where / "o.h5", {"base": {"wav": wav, "act": np.zeros((2, 320), np.float32)}})
    zstore.convert(other, dst, rates={"wav": 16000}, workers=1, progress=False)
    return src, dst


def test_appends_of_a_file_with_virtual_datasets_and_of_their_source_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src, dst = _base_and_virtual(tmp_path)
    zstore.append(src, dst, workers=1, progress=False)
    again = zstore.append(src, dst, workers=1, progress=False)
    assert again.converted == 0 and again.already_in_store == [src]
    # a source file of its virtual dataset is no source of the store's items: appended,
    # its own recording is added (also to a store converted from the file, whose
    # fingerprint names it)
    added = zstore.append(str(tmp_path / "part1.h5"), dst, workers=1, progress=False)
    assert added.converted == 1
    made = str(tmp_path / "made.zarr")
    zstore.convert(src, made, rates={"wav": 16000}, workers=1, progress=False)
    added = zstore.append(str(tmp_path / "part1.h5"), made, workers=1, progress=False)
    assert added.converted == 1
    with h5py.File(tmp_path / "part0.h5", "r+") as f:
        f["seg0/wav"][...] = 0
    with pytest.raises(zstore.SourceError, match=r"part0.h5, which its datasets read, has"):
        zstore.append(src, dst, workers=1, progress=False)


def test_a_killed_append_rerun_after_a_virtual_source_changed_writes_the_new_values(
    tmp_path, monkeypatch
):
    import importlib

    append_module = importlib.import_module("zstore.convert.append")
    monkeypatch.chdir(tmp_path)
    src, dst = _base_and_virtual(tmp_path)

    def killed(*args, **kwargs):  # the items are written and marked; then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(append_module, "publish", killed)
    with pytest.raises(KeyboardInterrupt):
        zstore.append(src, dst, workers=1, progress=False)
    monkeypatch.setattr(append_module, "publish", importlib.import_module("zstore.format").publish)
    with h5py.File(tmp_path / "part0.h5", "r+") as f:
        f["seg0/wav"][...] = 0.5
    report = zstore.append(src, dst, workers=1, progress=False)
    assert report.converted == 2  # the killed run's items are of another version
    ds = zstore.WindowDataset(dst, window_seconds=None, cache=False)
    got = {ds[i]["item"]: ds[i]["wav"].numpy() for i in range(len(ds))}
    assert (got["rec_000"][:, :16000] == 0.5).all()


@pytest.mark.parametrize("pack_seconds", [10.0, 0.0])
def test_transcripts_of_appended_items_are_their_attributes(tmp_path, pack_seconds):
    def text(g, i):
        g["text"] = f"utterance {i}"

    a = speech(tmp_path / "a.h5", [1.0, 2.0], text)
    b = str(tmp_path / "b.h5")
    with h5py.File(b, "w") as f:
        for i, seconds in enumerate([1.5, 12.0]):
            f[f"more_{i}/wav"] = np.zeros((2, int(16000 * seconds)), np.float32)
            f[f"more_{i}/act"] = np.zeros((2, int(100 * seconds)), np.float32)
            f[f"more_{i}/text"] = np.array(["more", f"words {i}"], dtype=h5py.string_dtype())
    store = tmp_path / "s.zarr"
    options = {"rates": {"wav": 16000}, "workers": 1, "progress": False}
    zstore.convert(a, store, pack_seconds=pack_seconds, **options)
    report = zstore.append(b, store, **options)
    assert report.texts == {"text": 2}
    ds = zstore.WindowDataset(store, window_seconds=None, cache=False)
    got = {ds[i]["item"]: ds.item_attrs(i)["text"] for i in range(len(ds))}
    assert got == {
        "rec_000": "utterance 0",
        "rec_001": "utterance 1",
        "more_0": ["more", "words 0"],
        "more_1": ["more", "words 1"],
    }


def _recording_file(path, seconds: float, speaker: str, sr: int = 16000) -> dict:
    """One recording per file, written as many scripts do: its datasets at the root."""
    rng = np.random.default_rng(len(str(path)) + int(seconds * 10))
    values = {
        "wav": rng.integers(-3000, 3000, (2, int(16000 * seconds))).astype(np.float32),
        "act": (rng.random((2, int(100 * seconds))) > 0.5).astype(np.float32),
    }
    with h5py.File(path, "w") as f:
        for name, data in values.items():
            f[name] = data
        f["text"] = f"said by {speaker}"
        f.attrs["speaker"] = speaker
        f.attrs["sr"] = sr
    return values


@pytest.mark.parametrize("pack_seconds", [10.0, 0.0])
def test_files_of_one_recording_each_with_datasets_at_their_root(tmp_path, pack_seconds):
    """A file whose datasets all lie at its root is one item, named by the file's stem,
    with the root's attributes and strings; such files were refused ("holds no groups
    with numeric datasets")."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    want = {
        f"utt{i}": _recording_file(corpus / f"utt{i}.h5", seconds, f"spk{i}")
        for i, seconds in enumerate([2.0, 3.5, 30.0])
    }
    store = tmp_path / "s.zarr"
    options = {"rates": {"wav": 16000}, "workers": 2, "progress": False}
    report = zstore.convert(str(corpus), store, pack_seconds=pack_seconds, verify=True, **options)
    assert report.items == 3 and not report.skipped
    want["late"] = _recording_file(tmp_path / "late.h5", 1.5, "spk9")
    zstore.append(str(tmp_path / "late.h5"), store, **options)
    ds = zstore.WindowDataset(store, window_seconds=None, attrs=["speaker", "text"], cache=False)
    assert sorted(ds[i]["item"] for i in range(len(ds))) == sorted(want)
    for i in range(len(ds)):
        w = ds[i]
        for name, values in want[w["item"]].items():
            np.testing.assert_array_equal(w[name].numpy(), values)
        speaker = "spk9" if w["item"] == "late" else f"spk{w['item'][3:]}"
        assert (w["speaker"], w["text"]) == (speaker, f"said by {speaker}")
    single = tmp_path / "single.zarr"  # one such file alone: its item named by its stem
    zstore.convert(str(corpus / "utt1.h5"), single, **options)
    assert zstore.WindowDataset(single, window_seconds=None, cache=False)[0]["item"] == "utt1"


def test_a_whole_file_item_stating_another_rate_is_refused(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _recording_file(corpus / "a.h5", 2.0, "spk0")
    _recording_file(corpus / "b.h5", 2.0, "spk1", sr=8000)
    with pytest.raises(zstore.SourceError, match="sr=8000"):
        zstore.convert(str(corpus), tmp_path / "s.zarr", rates={"wav": 16000}, progress=False)


def test_datasets_at_the_root_beside_groups_of_recordings_are_left_out(tmp_path):
    src = speech(tmp_path / "mixed.h5", [1.0, 2.0])
    with h5py.File(src, "a") as f:
        f["sample_rate"] = 16000
    with pytest.warns(UserWarning, match="sample_rate: dataset at the file's root"):
        report = zstore.convert(
            src, tmp_path / "s.zarr", rates={"wav": 16000}, workers=1, progress=False
        )
    assert report.items == 2


def test_a_file_of_one_dataset_per_utterance_is_not_taken_for_one_recording(tmp_path):
    """Datasets at the root named as utterances (``f[utt_id] = audio``) are no one
    recording's arrays: without --dataset-items the file is refused as before, and the
    error names both readings."""
    with h5py.File(tmp_path / "flat.h5", "w") as f:
        for i in range(3):
            f[f"utt{i}"] = np.zeros((1, 16000), np.float32)
    with pytest.raises(zstore.SourceError, match="--dataset-items wav.*--rate utt0=16000"):
        zstore.convert(tmp_path / "flat.h5", tmp_path / "s.zarr", rates={"wav": 16000})


def test_ragged_arrays_are_left_out_saying_how_to_store_them(tmp_path):
    """Word alignments as a variable-length float dataset (one list of times per word)
    have no Zarr array to go to: left out, one line for all groups, saying what they are
    and how to store them; the rest of each item converts."""
    src = tmp_path / "a.h5"
    with h5py.File(src, "w") as f:
        for i in range(4):
            g = f.create_group(f"u{i}")
            g["wav"] = np.full((1, 16000), i, np.int16)
            align = g.create_dataset("align", (3,), dtype=h5py.vlen_dtype(np.float32))
            for k in range(3):
                align[k] = np.arange(k + 1, dtype=np.float32)
            g["kind"] = np.array([b"a"], dtype=h5py.opaque_dtype(np.dtype("V1")))
    report = zstore.convert(
        src, tmp_path / "a.zarr", rates={"wav": 16000}, workers=1, progress=False
    )
    said = "\n".join(report.skipped)
    assert "align: ragged arrays (variable-length float32), which no Zarr array holds; " in said
    assert "one flat array of the values and one of their offsets, or padded, in 4 groups" in said
    assert "kind: non-numeric dtype |V1, in 4 groups" in said
    assert report.items == 4
