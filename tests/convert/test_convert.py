import importlib
import json
import os
import signal
import subprocess
import uuid
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr
from conftest import PYTHON, RATES, kill_when, manifest_of, subprocess_env, write_h5

import zstore
from zstore.format.layout import MANIFEST_ATTR
from zstore.synthetic import SyntheticSpec, make_synthetic


def same_manifest(a, b) -> bool:
    return (
        list(a.items) == list(b.items)
        and a.arrays == b.arrays
        and a.lengths.keys() == b.lengths.keys()
        and all(np.array_equal(a.lengths[n], b.lengths[n]) for n in a.lengths)
    )


def packed_spans(store) -> dict[str, tuple[str, int, int]]:
    """``item/array`` -> (packed array, offset, length) of every packed item, from the
    batch records, as a reader without zstore finds them (the README's recipe)."""
    out = {}
    for record in Path(store).glob("zstore_packed/*/items.*.json"):
        doc = json.loads(record.read_text())
        for name in doc["offsets"]:
            for k, item in enumerate(doc["items"]):
                path = f"zstore_packed/{record.parent.name}/{name}"
                out[f"{item}/{name}"] = (path, doc["offsets"][name][k], doc["lengths"][name][k])
    return out


def stored_array(root, spans, name):
    """``item/array`` of a store through zarr-python: its own array, or its span of a
    pack group's (time last)."""
    if name in spans:
        path, offset, length = spans[name]
        return root[path][..., offset : offset + length]
    return root[name][...]


def assert_same_as_source(h5_path, store):
    root = zarr.open_group(store, mode="r")
    spans = packed_spans(store)
    with h5py.File(h5_path, "r") as f:
        names: list[str] = []
        f.visititems(
            lambda name, obj: (
                names.append(name)
                if isinstance(obj, h5py.Dataset) and obj.dtype.kind in "biufc"
                else None
            )
        )
        # zarr is read after the visit, not inside it: h5py holds its global lock through
        # the visit, and an h5py object collected meanwhile in zarr's I/O thread waits on
        # that lock while the visit waits on zarr (a deadlock)
        for name in names:
            got = stored_array(root, spans, name)
            assert got.dtype == f[name].dtype and got.shape == f[name].shape, name
            assert got.tobytes() == f[name][()].tobytes(), name


def test_round_trip_is_bit_identical(small_h5, small_store):
    assert_same_as_source(small_h5, small_store)
    m = manifest_of(small_store)
    assert m.arrays["wav"].rate == 16000 and m.arrays["act"].rate == 100
    assert len(m.items) == 6 and len(m.lengths["wav"]) == 6
    root = zarr.open_group(small_store, mode="r")
    with h5py.File(small_h5) as f:
        assert m.lengths["act"][0] == f[m.items[0]]["act"].shape[-1]
        assert root[m.items[0]].attrs["speaker_count"] == 2


def test_time_axis_is_chunked_and_sharded(small_store):
    root = zarr.open_group(small_store, mode="r")
    wav = root["utt000000/wav"]
    assert wav.chunks == (2, 16000)  # about one second, other axes whole
    assert wav.shards is not None and wav.shards[1] % 16000 == 0
    codecs = [c["name"] for c in wav.metadata.to_dict()["codecs"][0]["configuration"]["codecs"]]
    assert codecs == ["bytes", "blosc", "crc32c"]


def test_nested_groups_attributes_inference_and_static_arrays(tmp_path):
    rng = np.random.default_rng(0)
    items, attrs = {}, {}
    for i, n in enumerate([4800, 8000, 6400]):
        items[f"spk{i % 2}/utt{i}"] = {
            "wav": rng.integers(-3000, 3000, (2, n)).astype(np.int16),
            "act": (rng.random((3, n // 160)) > 0.5).astype(np.float32),
            "emb": rng.random(16).astype(np.float32),
            "text": np.array([b"hello"], dtype="S5"),
        }
        attrs[f"spk{i % 2}/utt{i}"] = {"lang": "en", "snr": 12.5, "ids": np.arange(3)}
    src = write_h5(tmp_path / "nested.h5", items, attrs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left out: the text is an attribute
        report = zstore.convert(
            src,
            tmp_path / "s.zarr",
            rates={"wav": 16000},
            workers=1,
            progress=False,
            pack_seconds=0,  # each item its own group, read here through zarr
        )
    assert report.arrays["act"].rate == 100 and report.arrays["act"].inferred
    assert report.arrays["emb"].rate is None
    assert not report.skipped
    assert "(inferred)" in str(report) and "stored whole" in str(report)
    root = zarr.open_group(tmp_path / "s.zarr", mode="r")
    assert sorted(manifest_of(tmp_path / "s.zarr").items) == sorted(items)
    attrs = dict(root["spk1/utt1"].attrs)
    assert len(attrs.pop("zstore_digest")) == 16  # a checksum of its values (copies)
    assert attrs == {
        "lang": "en",
        "snr": 12.5,
        "ids": [0, 1, 2],
        "text": ["hello"],  # the string dataset
        "zstore_complete": True,
    }
    for name, arrays in items.items():
        for k in ("wav", "act", "emb"):
            np.testing.assert_array_equal(root[f"{name}/{k}"][...], arrays[k])
    assert "text" not in root["spk0/utt0"]


def test_parallel_equals_serial(small_h5, tmp_path):
    zstore.convert(small_h5, tmp_path / "serial.zarr", rates=RATES, workers=1, progress=False)
    zstore.convert(small_h5, tmp_path / "par.zarr", rates=RATES, workers=2, progress=False)
    a, b = (zarr.open_group(tmp_path / n, mode="r") for n in ("serial.zarr", "par.zarr"))
    ma, mb = manifest_of(tmp_path / "serial.zarr"), manifest_of(tmp_path / "par.zarr")
    assert same_manifest(ma, mb) and ma.store_id != mb.store_id
    sa, sb = packed_spans(tmp_path / "serial.zarr"), packed_spans(tmp_path / "par.zarr")
    assert sa == sb and 0 < len(sa) < 2 * len(ma.items)  # packed and own items, alike
    for item in ma.items:
        for name in ("wav", "act"):
            x, y = stored_array(a, sa, f"{item}/{name}"), stored_array(b, sb, f"{item}/{name}")
            assert x.tobytes() == y.tobytes()
    files_a = sorted(
        p.relative_to(tmp_path / "serial.zarr") for p in (tmp_path / "serial.zarr").rglob("c/*/*")
    )
    files_b = sorted(
        p.relative_to(tmp_path / "par.zarr") for p in (tmp_path / "par.zarr").rglob("c/*/*")
    )
    assert files_a == files_b and files_a
    for rel in files_a:
        assert (tmp_path / "serial.zarr" / rel).read_bytes() == (
            tmp_path / "par.zarr" / rel
        ).read_bytes()


def test_rerun_on_finished_store_does_nothing(small_h5, tmp_path):
    dst = tmp_path / "s.zarr"
    first = zstore.convert(small_h5, dst, rates=RATES, workers=1, progress=False)
    before = {p: p.stat().st_mtime_ns for p in dst.rglob("*") if p.is_file()}
    again = zstore.convert(small_h5, dst, rates=RATES, workers=1, progress=False)
    assert (again.converted, again.already_done) == (0, first.items)
    assert {p: p.stat().st_mtime_ns for p in dst.rglob("*") if p.is_file()} == before


def test_resume_after_sigkill(tmp_path):
    src = tmp_path / "big.h5"
    make_synthetic(
        src, SyntheticSpec(items=12, mics=8, speakers=2, min_seconds=20, max_seconds=30, seed=3)
    )
    dst = tmp_path / "s.zarr"
    cmd = [
        PYTHON,
        "-m",
        "zstore.cli",
        "convert",
        str(src),
        str(dst),
        "--rate",
        "wav=16000",
        "--rate",
        "act=100",
        "--workers",
        "1",
        "--no-progress",
    ]
    proc = subprocess.Popen(
        cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    # Synchronize on the files the converter writes: kill once an item is complete.
    kill_when(proc, lambda: bool(_completed(dst)))
    assert proc.returncode == -signal.SIGKILL, "the converter finished before it was killed"
    done = _completed(dst)
    assert done and MANIFEST_ATTR not in dict(zarr.open_group(dst, mode="r").attrs)
    kept = {p: p.stat().st_mtime_ns for item in done for p in (dst / item).rglob("c/*/*")}
    report = zstore.convert(src, dst, rates=RATES, workers=1, progress=False)
    assert report.already_done == len(done) and report.converted == 12 - len(done)
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # finished items not rewritten
    assert_same_as_source(src, dst)
    clean = tmp_path / "clean.zarr"
    zstore.convert(src, clean, rates=RATES, workers=1, progress=False)
    m, mc = manifest_of(dst), manifest_of(clean)
    assert same_manifest(m, mc)


def test_a_rerun_after_a_kill_during_the_first_root_write_converts(small_h5, tmp_path):
    """A converter killed while zarr wrote the store's first root leaves only zarr's
    temporary file (``zarr.<32 hex digits>.partial``; found by tools/random_corpora.py
    kills): the rerun converts, where it refused the destination as "not empty".  A
    file of the user's beside it is still refused."""
    dst = tmp_path / "s.zarr"
    dst.mkdir()
    (dst / f"zarr.{uuid.uuid4().hex}.partial").write_bytes(b'{"zarr_format": 3, "no')
    (dst / "zstore.lock").write_text("")  # the killed converter's lock, as it left it
    report = zstore.convert(small_h5, dst, rates=RATES, workers=1, progress=False)
    assert report.converted == report.items > 0
    assert not list(dst.glob("*.partial"))
    assert_same_as_source(small_h5, dst)
    mine = tmp_path / "mine.zarr"
    mine.mkdir()
    (mine / f"zarr.{uuid.uuid4().hex}.partial").write_bytes(b"")
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(zstore.DestinationError, match="not empty"):
        zstore.convert(small_h5, mine, rates=RATES, workers=1, progress=False)
    assert (mine / "notes.txt").read_text() == "mine"


def test_a_rerun_after_a_kill_right_after_the_first_root_write_converts(
    small_h5, tmp_path, monkeypatch
):
    """The store's first root write already marks it as this conversion's: a converter
    dying right after it leaves a store its rerun resumes.  The root was first written bare and marked in a second write, and a
    kill between the two left "a Zarr hierarchy" the rerun refused (found by
    tools/random_corpora.py kills).  (The failed write stands for the kill: the file is
    whole on disk when it fails.)"""
    dst = tmp_path / "s.zarr"
    real = zarr.storage.LocalStore.set
    writes: list[str] = []

    async def dies_after_the_first_root(self, key, value):
        await real(self, key, value)
        if key == "zarr.json":  # written whole: the converter dies now
            writes.append(key)
            raise RuntimeError("killed")

    monkeypatch.setattr(zarr.storage.LocalStore, "set", dies_after_the_first_root)
    with pytest.raises(Exception, match="killed"):
        zstore.convert(small_h5, dst, rates=RATES, workers=1, progress=False)
    monkeypatch.undo()
    assert writes == ["zarr.json"]
    report = zstore.convert(small_h5, dst, rates=RATES, workers=1, progress=False)
    assert report.converted == report.items > 0
    assert_same_as_source(small_h5, dst)


def _completed(dst: Path) -> list[str]:
    import json

    done = []
    for meta in dst.glob("utt*/zarr.json"):
        try:
            if json.loads(meta.read_text()).get("attributes", {}).get("zstore_complete"):
                done.append(meta.parent.name)
        except ValueError:
            pass  # being written right now
    return done


def test_verify_catches_a_corrupted_chunk(small_h5, tmp_path):
    dst = tmp_path / "s.zarr"
    report = zstore.convert(
        small_h5, dst, rates=RATES, workers=1, progress=False, verify=True, pack_seconds=0
    )  # packed: tests/convert/test_packed.py
    assert report.verified and "verified" in str(report)
    shard = next((dst / "utt000002" / "wav").rglob("c/0/0"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(zstore.StoreFormatError, match="utt000002/wav"):
        zstore.convert(
            small_h5, dst, rates=RATES, workers=1, progress=False, verify=True, pack_seconds=0
        )


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_other_codecs(small_h5, tmp_path, codec):
    dst = tmp_path / f"{codec}.zarr"
    zstore.convert(small_h5, dst, rates=RATES, codec=codec, workers=1, progress=False)
    assert_same_as_source(small_h5, dst)
    assert manifest_of(dst).codec == codec


# --- bad input: one clear error, nothing half-written taken for done ----------------------


def test_missing_file(tmp_path):
    with pytest.raises(zstore.SourceError, match="no such HDF5 file"):
        zstore.convert(tmp_path / "nope.h5", tmp_path / "s.zarr", rates=RATES)


def test_truncated_file(small_h5, tmp_path):
    data = Path(small_h5).read_bytes()
    bad = tmp_path / "truncated.h5"
    bad.write_bytes(data[: len(data) // 3])
    with pytest.raises(zstore.SourceError, match="truncated or corrupt"):
        zstore.convert(bad, tmp_path / "s.zarr", rates=RATES, progress=False, workers=1)


def test_empty_files(tmp_path):
    (tmp_path / "zero.h5").write_bytes(b"")
    with pytest.raises(zstore.SourceError, match="empty"):
        zstore.convert(tmp_path / "zero.h5", tmp_path / "a.zarr", rates=RATES)
    h5py.File(tmp_path / "nogroups.h5", "w").close()
    with pytest.raises(zstore.SourceError, match="nothing to convert"):
        zstore.convert(tmp_path / "nogroups.h5", tmp_path / "b.zarr", rates=RATES)


def test_group_missing_an_array(tmp_path):
    src = write_h5(
        tmp_path / "m.h5",
        {
            "a": {"wav": np.zeros((1, 1600), np.float32), "act": np.zeros((1, 10), np.float32)},
            "b": {"wav": np.zeros((1, 1600), np.float32)},
        },
    )
    # stored where present (uneven groups); reading a field some items lack is the
    # dataset's choice (missing="error" by default)
    zstore.convert(src, tmp_path / "s.zarr", rates=RATES, workers=1, progress=False)
    with pytest.raises(zstore.ConfigError, match="'b'"):
        zstore.WindowDataset(tmp_path / "s.zarr", fields=["wav", "act"], cache=False)


def test_lengths_contradicting_rates(tmp_path):
    src = write_h5(
        tmp_path / "r.h5",
        {"a": {"wav": np.zeros((1, 16000), np.float32), "act": np.zeros((1, 50), np.float32)}},
    )
    with pytest.raises(
        zstore.SourceError, match="'a': 'act' lasts 0.500 s at 100/s but 'wav' lasts 1.000 s"
    ):
        zstore.convert(src, tmp_path / "s.zarr", rates=RATES)


def test_rate_for_unknown_array(small_h5, tmp_path):
    with pytest.raises(zstore.SourceError, match="no array named 'mic'"):
        zstore.convert(small_h5, tmp_path / "s.zarr", rates={"mic": 16000})


def test_destination_with_another_store_is_refused(small_h5, tmp_path):
    other = write_h5(tmp_path / "o.h5", {"x": {"wav": np.zeros((1, 3200), np.float32)}})
    dst = tmp_path / "s.zarr"
    zstore.convert(other, dst, rates={"wav": 16000}, workers=1, progress=False)
    with pytest.raises(zstore.DestinationError, match="--overwrite"):
        zstore.convert(small_h5, dst, rates=RATES, workers=1, progress=False)
    zstore.convert(small_h5, dst, rates=RATES, workers=1, progress=False, overwrite=True)
    assert len(manifest_of(dst).items) == 6


def test_a_refused_rerun_says_what_differs_from_the_store(tmp_path):
    """The refusal to write over a store converted otherwise says how: the options that
    differ (there and now), a source not given now or new, a source changed since (it
    said "another source or other options", and a source merely touched read as
    another).  The store is left as it was."""
    src = write_h5(tmp_path / "a.h5", {"x": {"wav": np.zeros((1, 3200), np.float32)}})
    more = write_h5(tmp_path / "b.h5", {"y": {"wav": np.zeros((1, 3200), np.float32)}})
    dst = tmp_path / "s.zarr"
    zstore.convert(src, dst, rates={"wav": 16000}, workers=1, progress=False)
    root = (dst / "zarr.json").read_bytes()
    cases = [
        ([src], {"wav": 8000}, r"rates \{'wav': 16000.0\} there, \{'wav': 8000.0\} now"),
        ([src, more], {"wav": 16000}, r"sources not in it: .*b\.h5"),
    ]
    for sources, rates, said in cases:
        with pytest.raises(zstore.DestinationError, match=said):
            zstore.convert(sources, dst, rates=rates, workers=1, progress=False)
    st = Path(src).stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(zstore.DestinationError, match=r"a\.h5 changed since") as e:
        zstore.convert(src, dst, rates={"wav": 16000}, workers=1, progress=False)
    assert "--overwrite" in str(e.value) and "rates" not in str(e.value)
    assert (dst / "zarr.json").read_bytes() == root


def test_non_empty_destination_is_refused(small_h5, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    with pytest.raises(zstore.DestinationError, match="not empty"):
        zstore.convert(small_h5, tmp_path / "d", rates=RATES)
    assert (tmp_path / "d" / "notes.txt").read_text() == "mine"


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path):
    proc = subprocess.run(
        [
            PYTHON,
            "-m",
            "zstore.cli",
            "convert",
            str(tmp_path / "missing.h5"),
            str(tmp_path / "s.zarr"),
            "--rate",
            "wav=16000",
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "missing.h5" in proc.stderr and "no such HDF5 file" in proc.stderr
    bad = subprocess.run(
        [PYTHON, "-m", "zstore.cli", "convert", "a.h5", "b.zarr", "--rate", "wav"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "NAME=VALUE" in bad.stderr


def test_cli_convert_and_info(small_h5, tmp_path):
    dst = tmp_path / "s.zarr"
    proc = subprocess.run(
        [
            PYTHON,
            "-m",
            "zstore.cli",
            "convert",
            small_h5,
            str(dst),
            "--rate",
            "wav=16000",
            "--workers",
            "2",
            "--verify",
            "--no-progress",
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "act: time array at 100/s (inferred)" in proc.stdout and "verified" in proc.stdout
    info = subprocess.run(
        [PYTHON, "-m", "zstore.cli", "info", str(dst)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert info.returncode == 0, info.stderr
    assert "items: 6" in info.stdout and "wav: 16000/s" in info.stdout
    assert "act: 100/s (inferred)" in info.stdout and "lz4" in info.stdout
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert zstore.store_info(str(dst))["arrays"]["wav"]["chunk"] == [2, 16000]


def test_small_arrays_get_chunks_of_at_least_64_kB(tmp_path):
    rng = np.random.default_rng(2)
    long_act = (rng.random((3, 12000)) > 0.5).astype(np.float32)  # 120 s at 100/s
    src = write_h5(
        tmp_path / "a.h5",
        {"rec": {"wav": rng.standard_normal((1, 12000 * 160)).astype(np.float32), "act": long_act}},
    )
    dst = tmp_path / "a.zarr"
    zstore.convert(src, dst, rates={"wav": 16000, "act": 100}, workers=1, progress=False)
    root = zarr.open_group(dst, mode="r")
    assert root["rec/wav"].chunks == (1, 16000)  # 64 kB a second already
    act_chunk = root["rec/act"].chunks[1]
    assert act_chunk * 3 * 4 >= 64_000 and act_chunk < 12000  # ~54 s, not 1 s
    ds = zstore.WindowDataset(dst, window_seconds=10.0, cache=False)
    for epoch in range(5):
        ds.set_epoch(epoch)
        out = ds[0]
        start = round(out["start"] * 100)
        np.testing.assert_array_equal(out["act"].numpy(), long_act[:, start : start + 1000])


def test_options_as_any_mapping_and_sources_as_any_sequence(small_h5, tmp_path):
    """Read-only mappings for the options and a tuple of Paths for the sources convert
    as a dict and a list do (a mapping given as time_axis used to be taken for an axis
    number)."""
    from types import MappingProxyType

    plain = tmp_path / "plain.zarr"
    zstore.convert(small_h5, plain, rates={"wav": 16000, "act": 100}, time_axis={"wav": 1})
    other = tmp_path / "other.zarr"
    zstore.convert(
        (Path(small_h5),),
        other,
        rates=MappingProxyType({"wav": 16000, "act": 100}),
        time_axis=MappingProxyType({"wav": 1}),
        progress=False,
    )
    a, b = manifest_of(plain), manifest_of(other)
    assert list(a.items) == list(b.items)
    assert {n: (i.rate, i.time_axis) for n, i in a.arrays.items()} == {
        n: (i.rate, i.time_axis) for n, i in b.arrays.items()
    }


def test_file_urls_name_local_paths(small_h5, small_store, tmp_path):
    """``file://PATH`` is PATH, as in fsspec: for convert's sources and destination and
    for the readers (a reader took it for a relative path, a source was not found)."""
    dst = tmp_path / "by-url.zarr"
    zstore.convert(f"file://{small_h5}", f"file://{dst}", rates=RATES, workers=1, progress=False)
    by_path = zstore.WindowDataset(small_store, window_seconds=1.0, cache=False, seed=2)
    by_url = zstore.WindowDataset(f"file://{dst}", window_seconds=1.0, cache=False, seed=2)
    assert len(by_url) == len(by_path)
    for i in range(len(by_path)):
        a, b = by_path[i], by_url[i]
        assert (a["item"], a["start"]) == (b["item"], b["start"])
        np.testing.assert_array_equal(a["wav"].numpy(), b["wav"].numpy())


def test_a_path_from_the_home_directory(small_h5, tmp_path, monkeypatch):
    """``~`` in a store or source path is the user's home (as fsspec and the cache
    directories read it), not a directory named ``~``."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "in.h5").write_bytes(Path(small_h5).read_bytes())
    zstore.convert("~/in.h5", "~/s.zarr", rates=RATES, workers=1, progress=False)
    assert (tmp_path / "s.zarr" / "zarr.json").exists()
    ds = zstore.WindowDataset("~/s.zarr", window_seconds=1.0, cache=False)
    assert len(ds) == 6 and ds.reader.url == str(tmp_path / "s.zarr")


def test_an_overwrite_removes_the_root_before_any_object(small_h5, tmp_path, monkeypatch, s3):
    """A job reading a store being overwritten must find the root gone (or another
    store's) before any object it reads is gone: it is then told the store was
    replaced, not that it is damaged (removed in directory order, a job found a packed
    shard gone while the root was there; found by tools/random_corpora.py overwrites)."""
    import shutil

    import fsspec

    from zstore.convert._storelock import wipe

    dst = tmp_path / "s.zarr"
    zstore.convert(small_h5, dst, rates=RATES, workers=1, progress=False)
    removed: list[tuple[str, bool]] = []
    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        removed.append((os.path.basename(path), (dst / "zarr.json").exists()))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    wipe(str(dst))
    assert removed and not any(root_there for _, root_there in removed), removed
    monkeypatch.undo()

    options, _ = s3
    url = f"s3://zstore-test/wipe-{tmp_path.name}/s.zarr"
    zstore.convert(small_h5, url, rates=RATES, workers=1, progress=False, storage_options=options)
    fs, root = fsspec.core.url_to_fs(url, **options)  # the instance wipe gets too
    seen: list[bool] = []
    real_rm = fs.rm  # s3fs sets its sync methods on the instance

    def rm(path, *args, **kwargs):
        fs.invalidate_cache()
        seen.append(fs.exists(f"{root}/zarr.json"))
        return real_rm(path, *args, **kwargs)

    monkeypatch.setattr(fs, "rm", rm)
    wipe(url, options)
    assert seen and not any(seen), seen
    fs.invalidate_cache()
    assert fs.find(root) == []


def _dead_pid() -> int:
    proc = subprocess.Popen([PYTHON, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("pack_seconds", [0.0, 60.0])
def test_a_resumed_conversion_removes_what_killed_writes_left(
    small_h5, tmp_path, monkeypatch, pack_seconds
):
    """A writer killed between writing an object's temporary file and renaming it
    leaves ``<object>.<pid>.partial`` (zarr's ``zarr.<hex>.partial``); the rerun that
    resumes the conversion removes them (they were kept forever, until ``zstore
    tidy``), and the store it finishes is whole."""
    pipeline = importlib.import_module("zstore.convert.pipeline")
    dst = tmp_path / "s.zarr"
    options = dict(rates=RATES, workers=1, progress=False, pack_seconds=pack_seconds)
    monkeypatch.setattr(
        pipeline, "publish", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt)
    )
    with pytest.raises(KeyboardInterrupt):
        zstore.convert(small_h5, dst, **options)
    monkeypatch.undo()
    pid = _dead_pid()
    marks = sorted(dst.glob("*/zarr.json")) + sorted(dst.glob("zstore_packed/*/items.*.json"))
    left = [m.with_name(f"{m.name}.{pid}.partial") for m in marks[:2]]
    left.append(dst / f"zarr.{uuid.uuid4().hex}.partial")
    for path in left:
        path.write_bytes(b"cut short")
    report = zstore.convert(small_h5, dst, **options)
    assert report.items > 0 and MANIFEST_ATTR in dict(zarr.open_group(dst, mode="r").attrs)
    assert [p for p in left if p.exists()] == []
    assert not list(dst.rglob("*.partial"))
    ds = zstore.WindowDataset(str(dst), window_seconds=None, cache=False, fields=["wav"])
    with h5py.File(small_h5, "r") as f:
        for i in range(len(ds)):
            w = ds[i]
            np.testing.assert_array_equal(w["wav"].numpy(), f[w["item"]]["wav"][()])
