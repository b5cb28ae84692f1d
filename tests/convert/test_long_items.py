"""Long recordings converted a block of whole shards at a time: the same objects, values
and checksum as the whole array gives, in a worker's memory of a few blocks."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr
from conftest import subprocess_env, wait_until
from crc32c import crc32c

import zstore
from zstore.convert._copies import ArrayDigest, item_digest
from zstore.convert._crc import CRC32, CRC32C, combine

blocks_module = importlib.import_module("zstore.convert._blocks")

pytestmark = pytest.mark.filterwarnings("ignore:.*NaN")

RATES = {"wav": 16000, "act": 100, "mix": 16000, "enh": 16000, "feats": 100}


def _corpus(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """Long items in the forms recordings come in: (mics, samples) contiguous
    int16-valued float32 with a NaN; (samples, mics) chunked and gzip-compressed,
    big-endian; true float64 audio; and a (2, frames, 3) feature array whose time
    axis is in the middle, chunked with a whole minute along time."""
    rng = np.random.default_rng(0)
    n = 16000 * 200
    wav = np.round(rng.normal(0, 900, (3, n))).astype(np.float32)
    wav[1, 123_457] = np.nan
    items = {
        "meeting": {"wav": wav, "act": (rng.random((2, 200 * 100)) > 0.5).astype(np.float32)},
        "session": {"mix": np.round(rng.normal(0, 900, (n, 2))).astype(">f4")},
        "processed": {"enh": rng.normal(0, 0.1, (1, n)).astype(np.float64)},
        "features": {"feats": rng.normal(0, 1, (2, 200 * 100, 3)).astype(np.float32)},
    }
    with h5py.File(path, "w") as f:
        f.create_dataset("meeting/wav", data=items["meeting"]["wav"])
        f.create_dataset("meeting/act", data=items["meeting"]["act"])
        f.create_dataset(
            "session/mix", data=items["session"]["mix"], chunks=(48000, 2), compression="gzip"
        )
        f.create_dataset("processed/enh", data=items["processed"]["enh"])
        f.create_dataset("features/feats", data=items["features"]["feats"], chunks=(1, 6000, 3))
    return items


def _objects(store: Path) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(store):
        for name in files:
            key = os.path.relpath(os.path.join(root, name), store)
            if "/" in key and not key.startswith("zstore_"):  # the items' (not the table's)
                out[key] = Path(root, name).read_bytes()
    return out


def _convert(src: Path, dst: Path, **kw) -> zstore.ConvertReport:
    return zstore.convert(
        str(src),
        str(dst),
        rates=RATES,
        time_axis={"wav": -1, "act": -1, "mix": 0, "enh": -1, "feats": 1},
        workers=1,  # in this process, where the block size is patched
        progress=False,
        **kw,
    )


def test_long_items_in_blocks_store_what_whole_arrays_store(tmp_path, monkeypatch):
    src = tmp_path / "long.h5"
    items = _corpus(src)
    whole = _convert(src, tmp_path / "whole.zarr", verify=True, pack_seconds=0)
    monkeypatch.setattr(blocks_module, "BLOCK_BYTES", 1 << 20)  # 4-25 blocks an array
    read: list[tuple] = []
    real = blocks_module.blocks
    monkeypatch.setattr(
        importlib.import_module("zstore.convert._items"),
        "blocks",
        lambda *a: read.append(tuple(b.select for b in real(*a))) or real(*a),
    )
    parts = _convert(src, tmp_path / "parts.zarr", verify=True, pack_seconds=0)
    assert max(len(r) for r in read) >= 4 and sum(len(r) == 1 for r in read) >= 1  # act
    assert _objects(tmp_path / "whole.zarr") == _objects(tmp_path / "parts.zarr")
    assert parts.source_bytes == whole.source_bytes and parts.store_bytes == whole.store_bytes
    assert parts.values == whole.values  # what each array's values are, NaN counts
    assert "1 NaN or infinite value(s) in 1 item(s) ('meeting')" in str(parts)
    for item, arrays in items.items():
        for name, values in arrays.items():  # each array read back whole
            ds = zstore.WindowDataset(
                str(tmp_path / "parts.zarr"),
                window_seconds=None,
                fields=[name],
                items=[item],
                cache=False,
            )
            np.testing.assert_array_equal(ds[0][name].numpy(), values)
    for item, arrays in items.items():  # the checksum the whole values give
        mark = json.loads((tmp_path / "parts.zarr" / item / "zarr.json").read_text())
        assert mark["attributes"]["zstore_digest"] == item_digest(arrays)


def test_a_conversion_cut_short_inside_a_long_item_is_finished_by_a_rerun(tmp_path, monkeypatch):
    """A worker that fails after some of an item's blocks are written (a kill, a full
    disk) leaves the item unmarked; the same call again writes it whole, and the store
    holds what a conversion in one go does."""
    src = tmp_path / "long.h5"
    _corpus(src)
    _convert(src, tmp_path / "whole.zarr")
    monkeypatch.setattr(blocks_module, "BLOCK_BYTES", 1 << 20)
    items_module = importlib.import_module("zstore.convert._items")
    real, calls = items_module.encode_array, []

    def failing(*args):
        calls.append(args[-1])
        if args[-1] == 2:  # an array's third block
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(items_module, "encode_array", failing)
    with pytest.raises(zstore.DestinationError):
        _convert(src, tmp_path / "parts.zarr")
    assert calls[-3:] == [0, 1, 2]  # two blocks of an item written, not its mark
    monkeypatch.setattr(items_module, "encode_array", real)
    report = _convert(src, tmp_path / "parts.zarr", verify=True)
    assert report.converted >= 1 and report.converted + report.already_done == 4
    assert _objects(tmp_path / "whole.zarr") == _objects(tmp_path / "parts.zarr")


def test_verify_finds_a_damaged_object_in_a_later_block(tmp_path, monkeypatch):
    src = tmp_path / "long.h5"
    _corpus(src)
    monkeypatch.setattr(blocks_module, "BLOCK_BYTES", 1 << 20)
    store = tmp_path / "s.zarr"
    _convert(src, store)
    shard = store / "meeting" / "wav" / "c" / "0" / "2"  # the third block's shard
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(zstore.StoreFormatError, match="meeting/wav"):
        _convert(src, store, verify=True)  # a finished store: verified again


def test_a_worker_holds_a_few_blocks_of_a_long_item_not_the_item(tmp_path):
    """An item of 512 MB (4,000 s of 2 mics at 16 kHz, float32) converts in a fraction
    of its size of memory (110 MiB here); read whole, it took 740 MiB."""
    n = 16000 * 4000
    src = tmp_path / "hour.h5"
    with h5py.File(src, "w") as f:
        ds = f.create_dataset("rec/wav", shape=(2, n), dtype=np.float32)
        rng = np.random.default_rng(0)
        for start in range(0, n, 1 << 22):
            stop = min(n, start + (1 << 22))
            ds[:, start:stop] = np.round(rng.normal(0, 900, (2, stop - start)))
    script = textwrap.dedent(
        f"""
        import resource, zstore
        if __name__ == "__main__":
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            zstore.convert({str(src)!r}, {str(tmp_path / "s.zarr")!r},
                           rates={{"wav": 16000}}, workers=1, progress=False)
            grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
            print(grown * 1024)
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env=subprocess_env(),
        check=True,
    )
    grown = int(run.stdout.split()[-1])
    assert grown < 256 << 20, f"the conversion took {grown >> 20} MiB more memory"
    got = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")["rec/wav"]
    with h5py.File(src) as f:
        for start in (0, n // 2, n - 1000):
            np.testing.assert_array_equal(
                got[:, start : start + 1000], f["rec/wav"][:, start : start + 1000]
            )


def test_a_long_item_in_blocks_on_s3(tmp_path, monkeypatch, s3):
    """Each block's objects go to the store as they are made (one PUT each), there as
    on a local path."""
    import s3fs

    options, _ = s3
    src = tmp_path / "long.h5"
    items = _corpus(src)
    monkeypatch.setattr(blocks_module, "BLOCK_BYTES", 1 << 20)
    url = "s3://zstore-test/long-blocks.zarr"
    _convert(src, url, storage_options=options, verify=True)
    _convert(src, tmp_path / "local.zarr")
    fs = s3fs.S3FileSystem(**options)
    local = _objects(tmp_path / "local.zarr")
    assert {k: fs.cat_file(f"{url}/{k}") for k in local} == local
    ds = zstore.WindowDataset(
        url,
        window_seconds=None,
        fields=["mix"],
        items=["session"],
        storage_options=options,
        cache=False,
    )
    np.testing.assert_array_equal(ds[0]["mix"].numpy(), items["session"]["mix"])


@pytest.mark.parametrize(
    ("shape", "dtype", "axis", "per"),
    [
        ((8, 300_001), "<f4", -1, 1000),  # (mics, samples), a block not of whole rows
        ((8, 300_001), ">f4", 1, 77_777),  # big-endian
        ((300_001, 3), "<i2", 0, 50_000),  # (samples, mics): blocks are contiguous
        ((2, 5, 400_000), "<f8", 2, 123_457),  # sampled blocks across rows
        ((3, 1000, 7), "<f4", 1, 333),  # time in the middle, small: every byte in both
        ((1, 2_000_000), "<i2", 1, 65_536),
    ],
)
def test_a_checksum_taken_block_by_block_is_the_whole_arrays(shape, dtype, axis, per):
    rng = np.random.default_rng(1)
    values = rng.normal(size=shape).astype(dtype)
    label = rng.normal(size=(3, 9)).astype(np.float32)
    digest = ArrayDigest("wav", shape, axis)
    for start in range(0, shape[axis], per):
        select = [slice(None)] * len(shape)
        select[axis] = slice(start, start + per)
        digest.add(values[tuple(select)], start)
    whole = item_digest({"wav": values, "act": label, "z": label})
    assert item_digest({"act": label, "z": label}, {"wav": digest}) == whole
    changed = values.copy()
    changed.reshape(-1)[-1] += 1  # the last value of the last row
    assert item_digest({"wav": changed, "act": label, "z": label}) != whole


@pytest.mark.parametrize("n", [0, 1, 5, 4096, 1_000_003])
def test_crcs_combine_without_their_bytes(n):
    first, second = os.urandom(777), os.urandom(n)
    assert combine(zlib.crc32(first), zlib.crc32(second), n, CRC32) == zlib.crc32(first + second)
    assert combine(crc32c(first), crc32c(second), n, CRC32C) == crc32c(first + second)


def test_blocks_are_whole_shards_and_whole_source_chunks(tmp_path):
    """Blocks of ~BLOCK_BYTES in whole shards; where the source's own compressed HDF5
    chunks are longer along time, a block holds at least one (none is decompressed more
    than twice), and one chunk of all the time is read whole; uncompressed chunks are
    read in part.  Short arrays, arrays with no time axis and compound fields are read
    whole."""
    from zstore.format import ArrayInfo

    blocks = blocks_module.blocks
    wav = ArrayInfo(rate=16000, time_axis=-1)
    with h5py.File(tmp_path / "b.h5", "w") as f:
        n = 16000 * 3600
        plain = f.create_dataset("plain", shape=(8, n), dtype=np.float32)
        got = blocks(plain, (8, n), wav, 1.0, 4)
        shard = 64 * 16000  # 64 chunks of 1 s
        assert [b.start for b in got] == list(range(0, n, 2 * shard))  # 2 shards: 64 MiB
        assert [b.first for b in got] == list(range(0, n // shard + 1, 2))
        assert got[-1].select == (slice(None), slice(got[-1].start, n))
        minutes = f.create_dataset(
            "minutes", shape=(8, n), dtype=np.float32, chunks=(1, 16000 * 600), compression="lzf"
        )
        got = blocks(minutes, (8, n), wav, 1.0, 4)
        assert [b.start for b in got] == list(range(0, n, 10 * shard))  # >= 600 s, whole shards
        hour = f.create_dataset("hour", shape=(8, n), dtype=np.float32, chunks=(1, n))
        assert [b.start for b in blocks(hour, (8, n), wav, 1.0, 4)] == list(range(0, n, 2 * shard))
        packed = f.create_dataset(
            "packed", shape=(8, n), dtype=np.float32, chunks=(1, n), compression="gzip"
        )
        assert blocks(packed, (8, n), wav, 1.0, 4) == [blocks_module.WHOLE]
        short = f.create_dataset("short", shape=(8, 16000 * 60), dtype=np.float32)
        assert blocks(short, (8, 16000 * 60), wav, 1.0, 4) == [blocks_module.WHOLE]
        static = ArrayInfo(rate=None, time_axis=None)
        assert blocks(plain, (8, n), static, 1.0, 4) == [blocks_module.WHOLE]
        table = f.create_dataset("table", shape=(n,), dtype=[("x", "<f4"), ("y", "<f4")])
        field = importlib.import_module("zstore.convert._fields").FieldView(table, "x")
        assert blocks(field, (n,), wav, 1.0, 4) == [blocks_module.WHOLE]


def test_the_progress_bar_moves_within_a_long_item(tmp_path, monkeypatch):
    """A long item takes minutes: the bar counts its blocks' bytes as they are written
    (in this process with one worker), and takes them back once the item is counted."""
    src = tmp_path / "long.h5"
    _corpus(src)
    monkeypatch.setattr(blocks_module, "BLOCK_BYTES", 1 << 20)
    items_module = importlib.import_module("zstore.convert._items")
    seen: list[tuple[int, int]] = []  # (items done, bytes in flight) at each block

    class Watched(items_module.Progress):
        def add_in_flight(self, nbytes):
            super().add_in_flight(nbytes)
            seen.append((self.bar.n, self.in_flight))

    monkeypatch.setattr(items_module, "Progress", Watched)
    _convert(src, tmp_path / "s.zarr", pack_seconds=0)
    assert len([b for n, b in seen if n == 0 and b > 0]) >= 4  # before an item is done
    values = [b for _, b in seen]
    assert all(b > a or b == 0 for a, b in zip([0, *values], values))  # up, then back whole
    assert values[-1] == 0


def test_the_progress_bar_shows_what_workers_have_in_flight(tmp_path):
    """The workers' count reaches the converting process's bar while their tasks run."""
    from workers import in_flight_until_seen

    tasks = importlib.import_module("zstore.convert._tasks")
    flag = tmp_path / "seen"
    shown = []

    class Watched(tasks.Progress):
        def set_in_flight(self, nbytes, refresh=True):
            super().set_in_flight(nbytes, refresh)
            shown.append(nbytes)
            if nbytes >= 1000:
                flag.touch()

    items = [importlib.import_module("zstore.convert._source").SourceItem("a", {}, {}, 10)]
    bar = Watched(1, "convert", False)
    with tasks.local_pool(2) as pool:
        done = tasks.run_batches(in_flight_until_seen, str(flag), items, 2, bar, pool=pool)
    assert done == [1] and 1000 in shown and bar.in_flight == 0 and bar.bytes == 10


def _interrupted_in_task(job, batch):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as it reaches a worker inside a task
    return batch  # not reached: the worker's handler ends the task


def test_ctrl_c_inside_a_workers_task_is_a_keyboard_interrupt_here():
    """Ctrl-C reaches the workers as well as this process: a worker inside a task ends
    it quietly (SystemExit(130)), and the pool hands that back as the task's outcome.
    Taken before this process's own KeyboardInterrupt, it ended the converter with
    status 130 and not a line (seen once in a fresh-clone CI run of the test below), and
    would end a caller's Python as quietly: it is a KeyboardInterrupt here."""
    from zstore.convert._tasks import Progress, local_pool, run_batches

    with local_pool(2) as pool, pytest.raises(KeyboardInterrupt):
        bar = Progress(1, "converting", False)
        run_batches(_interrupted_in_task, None, [], 2, bar, pool=pool, tasks=[["rec"]])


#: a worker held at its start (in ``site``, before its imports) until the test says go
_HOLD_AT_START = """
import os, sys, time
if "--multiprocessing-fork" in sys.argv:
    d = os.environ["ZSTORE_TEST_HOLD"]
    open(os.path.join(d, "started"), "w").close()
    while not os.path.exists(os.path.join(d, "go")):
        time.sleep(0.01)
"""

#: a pool whose worker Ctrl-C reaches while it starts
_CTRL_C_AT_START = """
import os, signal, time
from zstore.convert._tasks import Pool
if __name__ == "__main__":
    d = os.environ["ZSTORE_TEST_HOLD"]
    pool = Pool(1)
    fut = pool.submit(int)
    while not os.path.exists(os.path.join(d, "started")):
        time.sleep(0.01)
    os.kill(next(iter(pool._processes)), signal.SIGINT)
    open(os.path.join(d, "go"), "w").close()
    try:
        print("result", fut.result(timeout=300))
    except BaseException as e:
        print("pool:", type(e).__name__)
"""


def test_ctrl_c_while_a_worker_starts_ends_it_without_a_word(tmp_path):
    """Ctrl-C that reaches a worker while it still starts (its imports take about a
    second) ends it quietly once it can, as an idle worker: no KeyboardInterrupt
    traceback of its imports under the converter's one line (seen in a fresh-clone CI
    run of the test below).  The worker is held at its start by a file, signalled, then
    let go."""
    site, hold = tmp_path / "site", tmp_path / "hold"
    site.mkdir()
    hold.mkdir()
    (site / "sitecustomize.py").write_text(_HOLD_AT_START)
    script = tmp_path / "ctrl_c.py"
    script.write_text(_CTRL_C_AT_START)
    env = subprocess_env()
    env["PYTHONPATH"] = str(site) + os.pathsep + env["PYTHONPATH"]
    env["ZSTORE_TEST_HOLD"] = str(hold)
    got = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    out = got.stdout + got.stderr
    assert got.returncode == 0, out
    assert "pool: BrokenProcessPool" in out, out  # the worker ended
    assert "KeyboardInterrupt" not in out and "Traceback" not in out, out


def test_ctrl_c_ends_a_conversion_in_one_line(tmp_path):
    """SIGINT to the process group (Ctrl-C) while one worker converts a long item and the
    other waits for a task: one line, no worker's traceback; a rerun finishes the store."""
    n = 16000 * 3000
    src = tmp_path / "long.h5"
    with h5py.File(src, "w") as f:
        ds = f.create_dataset("rec/wav", shape=(2, n), dtype=np.float32)
        for start in range(0, n, 1 << 22):
            ds[:, start : start + (1 << 22)] = start % 1000
    store = tmp_path / "s.zarr"
    args = ["convert", str(src), str(store), "--rate", "wav=16000", "--workers", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "zstore.cli", *args, "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
        start_new_session=True,
    )
    shards = store / "rec" / "wav" / "c" / "0"
    wait_until(proc, lambda: shards.is_dir() and any(shards.iterdir()))  # a block written
    assert proc.poll() is None, proc.communicate()[0]
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out
    assert "zstore: interrupted" in out and "Traceback" not in out, out
    again = subprocess.run(
        [sys.executable, "-m", "zstore.cli", *args, "--no-progress"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=600,
    )
    assert again.returncode == 0, again.stderr
    got = zarr.open_group(str(store), mode="r")["rec/wav"]
    assert got[1, n - 5 :].tolist() == [(n - 1) // (1 << 22) * (1 << 22) % 1000] * 5
