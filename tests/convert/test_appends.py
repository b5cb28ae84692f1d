"""Appends are transactions: refused whole when they disagree with the store, reruns add
nothing twice, a rerun after the source changed writes its items anew, and concurrent
appends lose no item."""

from __future__ import annotations

import importlib
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import (
    PYTHON,
    assert_one_line_error,
    cli,
    manifest_of,
    subprocess_env,
    write_h5,
)

import zstore
from zstore.testing import spawn_ranks

RATE = {"wav": 16000}


def speech(seed: int, seconds: list[float], dtype=np.float32, mics: int = 1, prefix: str = "rec"):
    rng = np.random.default_rng(seed)
    return {
        f"{prefix}{i}": {"wav": (rng.integers(-3000, 3000, (mics, int(s * 16000))).astype(dtype))}
        for i, s in enumerate(seconds)
    }


def base_store(tmp_path: Path) -> Path:
    src = write_h5(tmp_path / "base.h5", speech(1, [2.0, 3.0], prefix="base"))
    dst = tmp_path / "s.zarr"
    zstore.convert(src, dst, rates=RATE, workers=1, progress=False)
    return dst


def snapshot(dst: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()}


def whole(dst: Path, item: str) -> np.ndarray:
    ds = zstore.WindowDataset(dst, window_seconds=None, cache=False, items=[item])
    return ds[0]["wav"].numpy()


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.float64, np.int16])
def test_an_append_of_another_dtype_is_refused_and_the_store_unchanged(tmp_path, dtype):
    dst = base_store(tmp_path)
    before = snapshot(dst)
    new = write_h5(
        tmp_path / "new.h5", {"x": {"wav": np.array([[206, 2226, 2693] * 9000], dtype=dtype)}}
    )
    proc = cli("convert", new, str(dst), "--append", "--no-progress")
    assert_one_line_error(proc, "'x/wav'", np.dtype(dtype).name, "float32", "nothing was written")
    assert snapshot(dst) == before


def test_an_append_with_another_number_of_dimensions_is_refused(tmp_path):
    dst = base_store(tmp_path)
    before = snapshot(dst)
    new = write_h5(tmp_path / "new.h5", {"x": {"wav": np.zeros((1, 32000, 2), np.float32)}})
    proc = cli("convert", new, str(dst), "--append", "--no-progress")
    assert_one_line_error(proc, "'x/wav'", "(1, 32000, 2)", "2 in")
    assert snapshot(dst) == before


@pytest.mark.parametrize(
    "option",
    [
        ["--codec", "zstd"],
        ["--rate", "wav=8000"],
        ["--chunk-seconds", "2"],
        ["--time-axis", "wav=0"],
    ],
)
def test_append_options_other_than_the_stores_are_refused(tmp_path, option):
    dst = base_store(tmp_path)
    before = snapshot(dst)
    new = write_h5(tmp_path / "new.h5", speech(2, [1.0]))
    proc = cli("convert", new, str(dst), "--append", "--no-progress", *option)
    assert_one_line_error(proc, option[0], "the store has")
    assert snapshot(dst) == before
    same = cli(
        "convert",
        new,
        str(dst),
        "--append",
        "--no-progress",
        "--codec",
        "lz4",
        "--rate",
        "wav=16000",
    )  # stating the store's own options is fine
    assert same.returncode == 0, same.stderr


def test_a_rerun_of_a_finished_append_adds_nothing_and_says_so(tmp_path):
    dst = base_store(tmp_path)
    new = write_h5(tmp_path / "new.h5", speech(2, [1.0, 1.5]))
    first = cli("convert", new, str(dst), "--append", "--no-progress")
    assert first.returncode == 0, first.stderr
    items = list(manifest_of(dst).items)
    assert len(items) == 4
    before = snapshot(dst)
    again = cli("convert", new, str(dst), "--append", "--no-progress")
    assert again.returncode == 0, again.stderr
    assert "already in the store" in again.stdout and "new.h5" in again.stdout
    assert list(manifest_of(dst).items) == items and snapshot(dst) == before
    later = write_h5(tmp_path / "later.h5", speech(3, [1.0], prefix="late"))  # new, with a seen one
    mixed = zstore.append([new, later], dst, workers=1, progress=False)
    assert mixed.converted == 1 and mixed.already_in_store == [new]
    assert len(manifest_of(dst).items) == 5


def test_a_file_appended_again_under_another_name_adds_nothing(tmp_path):
    """A link (symbolic or hard) to a file the store holds, in the conversion's files or
    an append's, is that file: its items are not added twice under the link's stem."""
    dst = base_store(tmp_path)
    new = write_h5(tmp_path / "new.h5", speech(2, [1.0, 1.5]))
    (tmp_path / "links").mkdir()
    # made before the append: a new hard link changes the file's ctime, which an append
    # takes for a change of the file
    (tmp_path / "links" / "new_hard.h5").hardlink_to(new)
    zstore.append(new, dst, workers=1, progress=False)
    items = list(manifest_of(dst).items)
    before = snapshot(dst)
    (tmp_path / "links" / "base_again.h5").symlink_to(tmp_path / "base.h5")
    proc = cli("convert", str(tmp_path / "links"), str(dst), "--append", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "already in the store" in proc.stdout and "base_again.h5" in proc.stdout
    lines = proc.stderr.splitlines()
    assert any(
        line.startswith("zstore: warning: ") and "new_hard.h5: the same file as" in line
        for line in lines
    ), proc.stderr
    assert sum("the same file as" in line for line in lines) == 2, proc.stderr
    assert list(manifest_of(dst).items) == items and snapshot(dst) == before
    # changed since it was added, the link is refused as the file itself is
    write_h5(new, speech(9, [1.0, 2.0]))
    proc = cli("convert", str(tmp_path / "links" / "new_hard.h5"), str(dst), "--append")
    assert proc.returncode == 2 and "nothing was written" in proc.stderr, proc.stderr
    assert snapshot(dst) == before


def test_an_append_of_a_file_changed_since_it_was_added_is_refused(tmp_path):
    dst = base_store(tmp_path)
    new = tmp_path / "new.h5"
    write_h5(new, speech(2, [1.0]))
    zstore.append(new, dst, workers=1, progress=False)
    before = snapshot(dst)
    write_h5(new, speech(9, [1.0, 2.0]))
    proc = cli("convert", str(new), str(dst), "--append", "--no-progress")
    assert_one_line_error(proc, "new.h5", "changed since", "nothing was written")
    assert snapshot(dst) == before


def test_a_killed_append_rerun_after_the_file_changed_writes_the_new_values(tmp_path, monkeypatch):
    append_module = importlib.import_module("zstore.convert.append")

    dst = base_store(tmp_path)
    new = tmp_path / "new.h5"
    write_h5(new, speech(2, [1.0, 1.5]))

    def killed(*args, **kwargs):  # the items are written and marked; then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(append_module, "publish", killed)
    with pytest.raises(KeyboardInterrupt):
        zstore.append(new, dst, workers=1, progress=False)
    monkeypatch.undo()
    assert len(manifest_of(dst).items) == 2  # nothing published
    changed = speech(7, [1.0, 1.5])  # same shapes, other values
    write_h5(new, changed)
    report = zstore.append(new, dst, workers=1, progress=False, verify=True)
    assert report.converted == 2  # the killed run's items are of another version
    for name, arrays in changed.items():
        assert np.array_equal(whole(dst, name), arrays["wav"])


def killed_before_publishing(monkeypatch, new: str, dst: Path) -> None:
    """An append of ``new`` that writes its items and dies before it publishes them."""
    append_module = importlib.import_module("zstore.convert.append")
    monkeypatch.setattr(
        append_module, "publish", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt)
    )
    with pytest.raises(KeyboardInterrupt):
        zstore.append(new, dst, workers=1, progress=False)
    monkeypatch.undo()


def test_a_killed_append_rerun_unchanged_keeps_what_it_wrote(tmp_path, monkeypatch):
    dst = base_store(tmp_path)
    new = write_h5(tmp_path / "new.h5", speech(2, [1.0, 1.5]))
    killed_before_publishing(monkeypatch, new, dst)
    report = zstore.append(new, dst, workers=1, progress=False)
    assert report.converted == 0 and len(manifest_of(dst).items) == 4


def _append_one(rank, barrier, queue, dst, sources):
    barrier.wait(timeout=300)  # every process starts its append at once
    zstore.append(sources[rank], dst, workers=1, progress=False)
    queue.put(rank)


def test_concurrent_appends_lose_no_item(tmp_path):
    dst = base_store(tmp_path)
    sources = [
        write_h5(
            tmp_path / f"n{k}.h5",
            {f"k{k}_{i}": a for i, a in enumerate(speech(10 + k, [1.0, 1.2]).values())},
        )
        for k in range(3)
    ]
    spawn_ranks(
        _append_one, 3, lambda rank, barrier, queue: (rank, barrier, queue, str(dst), sources)
    )
    items = list(manifest_of(dst).items)  # by group, as the store was converted from one
    assert sorted(items) == sorted(  # file: whichever append published first
        ["base0", "base1"] + [f"k{k}_{i}" for k in range(3) for i in range(2)]
    )
    ds = zstore.WindowDataset(dst, window_seconds=None, cache=False)
    assert len(ds) == 8 and all(ds[i]["length"] > 0 for i in range(8))


def test_an_append_waits_for_the_lock_another_writer_holds(tmp_path):
    from zstore.convert._storelock import store_lock

    dst = base_store(tmp_path)
    new = write_h5(tmp_path / "new.h5", speech(2, [1.0]))
    with store_lock(str(dst)):
        proc = subprocess.Popen(
            [PYTHON, "-m", "zstore.cli", "convert", new, str(dst), "--append", "--no-progress"],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = proc.stderr.readline()  # it tells that it waits, then waits
        assert "waiting for another conversion or append" in line, line
        assert len(manifest_of(dst).items) == 2
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert len(manifest_of(dst).items) == 3


def test_every_append_names_its_items_as_the_conversion_did(tmp_path):
    """By group for a store converted from one file, by <file stem>/<group> for one
    converted from several: the second append as the first (it used to prefix its items
    once the store had two sources, its first append counted)."""
    one = base_store(tmp_path)
    for k in range(3):
        new = write_h5(tmp_path / f"n{k}.h5", speech(20 + k, [1.0], prefix=f"k{k}_"))
        zstore.append(new, one, workers=1, progress=False)
    assert sorted(manifest_of(one).items) == ["base0", "base1", "k0_0", "k1_0", "k2_0"]

    two = tmp_path / "two.zarr"
    files = [
        write_h5(tmp_path / f"{stem}.h5", speech(30 + k, [1.0, 1.5]))
        for k, stem in enumerate(["a", "b"])
    ]
    zstore.convert(files, two, rates=RATE, workers=1, progress=False)
    for k in range(2):
        new = write_h5(tmp_path / f"m{k}.h5", speech(40 + k, [1.0]))
        zstore.append(new, two, workers=1, progress=False)
    assert sorted(manifest_of(two).items) == [
        "a/rec0",
        "a/rec1",
        "b/rec0",
        "b/rec1",
        "m0/rec0",
        "m1/rec0",
    ]
    for name in manifest_of(two).items:  # each reads back as its source wrote it
        assert whole(two, name).shape[1] in (16000, 24000)


def _changed_while_written(monkeypatch, module_name: str, path: Path) -> None:
    """Change ``path`` in place (HDF5 writes values at the same offsets, as a job with
    HDF5_USE_FILE_LOCKING=FALSE can) once the items are written, before they are
    published: what a writer racing the conversion does."""
    module = importlib.import_module(module_name)
    original = module.write_all

    def write_all(*args, **kwargs):
        out = original(*args, **kwargs)
        with h5py.File(path, "r+") as f:
            f["rec0/wav"][...] = 0
        return out

    monkeypatch.setattr(module, "write_all", write_all)


def test_a_source_changed_while_converted_is_not_published(tmp_path, monkeypatch):
    src = Path(write_h5(tmp_path / "a.h5", speech(3, [2.0, 3.0])))
    dst = tmp_path / "a.zarr"
    _changed_while_written(monkeypatch, "zstore.convert.pipeline", src)
    with pytest.raises(zstore.SourceError, match="a.h5: the file changed while its items"):
        zstore.convert(src, dst, rates=RATE, workers=1, progress=False)
    monkeypatch.undo()
    with pytest.raises(zstore.ZstoreError, match="conversion has not finished.*run the same"):
        zstore.WindowDataset(dst, window_seconds=1.0, cache=False)
    proc = cli("convert", str(src), str(dst), "--rate", "wav=16000", "--no-progress")
    assert_one_line_error(proc, "changed since", "--overwrite")
    zstore.convert(src, dst, rates=RATE, workers=1, progress=False, overwrite=True)
    with h5py.File(src) as f:
        for name in ("rec0", "rec1"):
            assert np.array_equal(whole(dst, name), f[name]["wav"][()])


def test_a_source_changed_while_appended_is_not_published(tmp_path, monkeypatch):
    dst = base_store(tmp_path)
    before = manifest_of(dst).items
    new = Path(write_h5(tmp_path / "new.h5", speech(2, [1.0, 1.5])))
    _changed_while_written(monkeypatch, "zstore.convert.append", new)
    with pytest.raises(zstore.SourceError, match="new.h5: the file changed.*append it again"):
        zstore.append(new, dst, workers=1, progress=False)
    monkeypatch.undo()
    assert manifest_of(dst).items == before  # readers still see the store as it was
    report = zstore.append(new, dst, workers=1, progress=False)
    assert report.converted == 2
    with h5py.File(new) as f:
        for name in ("rec0", "rec1"):
            assert np.array_equal(whole(dst, name), f[name]["wav"][()])


def test_an_appends_ratio_is_of_what_it_added(tmp_path):
    dst = base_store(tmp_path)  # 5 s of audio
    before = manifest_of(dst).extra["store_bytes"]
    new = write_h5(tmp_path / "new.h5", speech(4, [4.0, 6.0]))
    report = zstore.append(new, dst, workers=1, progress=False)
    assert report.added_bytes == report.store_bytes - before > 0
    assert report.ratio == report.added_bytes / report.source_bytes < 1  # int16-valued
    assert f"of it added ({report.ratio:.2f}x)" in str(report)


def test_a_few_scalar_labels_get_no_ratio(tmp_path):
    items = speech(4, [4.0, 6.0])
    for i, name in enumerate(items):
        items[name]["gain"] = np.float32(0.25 + i)  # a float label per item: 8 bytes
    report = zstore.convert(
        write_h5(tmp_path / "a.h5", items), tmp_path / "a.zarr", rates=RATE, progress=False
    )
    assert report.values["gain"] == "true float32 values, stored lossless"


def test_a_source_on_s3_replaced_while_converted_or_appended_is_not_published(
    tmp_path, monkeypatch, s3
):
    """Each worker opens an object-store source on its own, so an object replaced while
    its items are read would give a store of both versions: its version (ETag) is
    checked before the store is published."""
    import io

    import fsspec

    options, _ = s3
    endpoint = options["client_kwargs"]["endpoint_url"]
    for key, value in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": options["key"],
        "AWS_SECRET_ACCESS_KEY": options["secret"],
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)

    def put(key: str, seed: int, prefix: str) -> str:
        raw = io.BytesIO()
        with h5py.File(raw, "w") as f:
            for name, arrays in speech(seed, [2.0, 3.0], prefix=prefix).items():
                f[f"{name}/wav"] = arrays["wav"]
        fs.pipe(f"zstore-test/sources/{key}", raw.getvalue())
        return f"s3://zstore-test/sources/{key}"

    originals = {}

    def replaced_while_written(module_name: str, key: str, prefix: str) -> None:
        module = importlib.import_module(module_name)
        original = originals.setdefault(module_name, module.write_all)

        def write_all(*args, **kwargs):
            out = original(*args, **kwargs)
            put(key, 99, prefix)
            return out

        monkeypatch.setattr(module, "write_all", write_all)

    def restored(module_name: str) -> None:
        monkeypatch.setattr(
            importlib.import_module(module_name), "write_all", originals[module_name]
        )

    src, dst = put("a.h5", 1, "rec"), tmp_path / "a.zarr"
    replaced_while_written("zstore.convert.pipeline", "a.h5", "rec")
    with pytest.raises(zstore.SourceError, match="a.h5: the object changed while its items"):
        zstore.convert(src, dst, rates=RATE, workers=1, progress=False)
    restored("zstore.convert.pipeline")
    zstore.convert(src, dst, rates=RATE, workers=1, progress=False, overwrite=True)
    new = put("new.h5", 2, "late")
    replaced_while_written("zstore.convert.append", "new.h5", "late")
    before = manifest_of(dst).items
    with pytest.raises(zstore.SourceError, match="new.h5: the object changed.*append it again"):
        zstore.append(new, dst, workers=1, progress=False)
    assert manifest_of(dst).items == before  # readers still see the store as it was
    restored("zstore.convert.append")
    assert zstore.append(new, dst, workers=1, progress=False).converted == 2
    with h5py.File(fs.open("zstore-test/sources/new.h5", "rb")) as f:
        assert np.array_equal(whole(dst, "late0"), f["late0/wav"][()])


def test_an_append_with_patterns_adds_the_items_a_file_in_the_store_was_converted_without(
    tmp_path,
):
    """Converted with --include 'train/*', the file's dev items can be appended later
    with --include 'dev/*'; a rerun adds nothing, and a plain append of the file still
    counts it as in the store."""
    data = {
        **speech(1, [1.0, 1.5, 2.0], prefix="train/u"),
        **speech(2, [1.2, 0.8], prefix="dev/u"),
    }
    src = write_h5(tmp_path / "corpus.h5", data)
    dst = tmp_path / "s.zarr"
    zstore.convert(src, dst, rates=RATE, include=["train/*"], workers=1, progress=False)
    assert sorted(manifest_of(dst).items) == ["train/u0", "train/u1", "train/u2"]
    report = zstore.append(src, dst, include=["dev/*"], workers=1, progress=False)
    assert report.converted == 2 and report.already_in_store == []
    assert sorted(manifest_of(dst).items) == sorted(data)
    for name in data:
        assert np.array_equal(whole(dst, name), data[name]["wav"])
    before = snapshot(dst)
    again = cli("convert", src, str(dst), "--append", "--include", "dev/*", "--no-progress")
    assert again.returncode == 0, again.stderr
    assert "already in the store" in again.stdout and snapshot(dst) == before
    plain = zstore.append(src, dst, workers=1, progress=False)
    assert plain.converted == 0 and plain.already_in_store == [src]
    assert snapshot(dst) == before


def test_a_lock_on_s3_left_by_a_killed_writer_of_this_host_is_named_at_once(tmp_path, s3, small_h5):
    """A converter killed on this host leaves its lock object: the next one says so at
    once (it waited 10 minutes first), names the object, and removes nothing; a lock of
    a process still running is waited for, then named."""
    import json
    import os
    import socket
    import sys

    import fsspec

    from zstore.convert._storelock import store_lock
    from zstore.processes import boot_and_namespace

    options, _ = s3
    url = f"s3://zstore-test/lock-{tmp_path.name}/s.zarr"
    fs, root = fsspec.core.url_to_fs(url, **options)

    def convert():
        return zstore.convert(
            small_h5,
            url,
            rates={"wav": 16000, "act": 100},
            workers=1,
            progress=False,
            storage_options=options,
        )

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    lock = {
        "host": socket.gethostname(),
        "pid": int(dead.stdout),
        "since": 0,
        **boot_and_namespace(),
    }
    fs.pipe_file(f"{root}/zstore.lock", json.dumps(lock).encode())
    with pytest.raises(zstore.DestinationError, match="no longer running") as err:
        convert()
    assert f"{url}/zstore.lock" in str(err.value) and f"pid {dead.stdout.strip()}" in str(err.value)
    assert fs.exists(f"{root}/zstore.lock")  # left for a person to remove
    held = [
        {**lock, "pid_ns": "pid:[1]"},  # the same name, another container: not judged
        {**lock, "pid": os.getpid()},  # a running process: waited for, then named
    ]
    for holder in held:
        fs.pipe_file(f"{root}/zstore.lock", json.dumps(holder).encode())
        with pytest.raises(zstore.DestinationError, match="another conversion or append holds"):
            with store_lock(url, options, wait=0.3):
                pass
    fs.rm_file(f"{root}/zstore.lock")
    report = convert()
    assert report.converted == report.items > 0


def test_a_resumed_append_removes_what_its_killed_writes_left(tmp_path, monkeypatch):
    """The rerun of a killed append removes the temporary files its killed writes left
    in the items it adds; those elsewhere in the store are for ``zstore tidy``."""
    src = write_h5(tmp_path / "base.h5", speech(1, [2.0, 3.0], prefix="base"))
    dst = tmp_path / "s.zarr"
    zstore.convert(src, dst, rates=RATE, workers=1, progress=False, pack_seconds=0)
    new = write_h5(tmp_path / "new.h5", speech(2, [1.0, 1.5]))
    killed_before_publishing(monkeypatch, new, dst)
    proc = subprocess.Popen([PYTHON, "-c", "pass"])
    proc.wait()  # a writer that is gone
    ours = dst / "rec0" / f"zarr.json.{proc.pid}.partial"
    ours.write_bytes(b"cut short")
    elsewhere = dst / "base0" / f"zarr.json.{proc.pid}.partial"
    elsewhere.write_bytes(b"cut short")
    report = zstore.append(new, dst, workers=1, progress=False)
    assert len(manifest_of(dst).items) == 4 and report.already_done == 4 - report.converted
    assert not ours.exists() and elsewhere.exists()
    assert zstore.tidy(dst).partials == ["base0/" + elsewhere.name]
