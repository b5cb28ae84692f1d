"""S3 through a real local endpoint (moto's ThreadedMotoServer on 127.0.0.1, via s3fs),
and origin faults through the modelled file system."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from conftest import PYTHON, same_layout_sources, subprocess_env

import zstore
from zstore.format.layout import Span
from zstore.origin import Origin, RetryPolicy
from zstore.read.reader import WindowReader
from zstore.testing import ModelledFileSystem


def test_reads_from_s3_send_no_head_requests(s3, s3_store, small_store):
    """The store's root is read beside every round of chunk reads (a store replaced
    under a job): one GET, as each chunk range is; s3fs reads a whole object with a HEAD
    for its size first, which made the root two round trips in each round."""
    options, counter = s3
    reader = WindowReader(s3_store, storage_options=options, cache=False).open()
    local = zstore.WindowDataset(small_store, window_seconds=None, cache=False)
    want = {local[i]["item"]: local[i]["wav"].numpy() for i in range(len(local))}
    before = len(counter.requests)
    for item, wav in want.items():
        got = reader.read(item, {"wav": Span(0, wav.shape[-1])})["wav"]
        assert np.array_equal(got, wav), item
    sent = counter.requests[before:]
    assert sum(1 for m, p in sent if m == "GET" and p.endswith("/zarr.json")) >= len(want)
    assert [r for r in sent if r[0] == "HEAD"] == []
    # zarr's API through open_store reads the root beside each round as well
    import zarr

    group = zarr.open_group(zstore.open_store(s3_store, storage_options=options), mode="r")
    before = len(counter.requests)
    item = next(iter(want))
    np.testing.assert_array_equal(group[f"{item}/wav"][:, 100:5000], want[item][:, 100:5000])
    sent = counter.requests[before:]
    root = [m for m, p in sent if p.endswith("/small.zarr/zarr.json")]
    assert root and "HEAD" not in root, sent
    # an object read whole that is empty reads as empty, and a missing one is missing
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    fs.pipe("zstore-test/whole/empty", b"")
    origin = Origin("s3://zstore-test/whole", options)
    assert origin.read("empty") == b""
    with pytest.raises(FileNotFoundError):
        origin.read("missing")


def test_s3_windows_equal_the_local_store(s3, s3_store, small_store, tmp_path):
    options, counter = s3
    cache = zstore.CacheConfig(
        ram_dir=tmp_path / "ram",
        ram_bytes="64MB",
        ssd_dir=tmp_path / "ssd",
        ssd_bytes="64MB",
        fetch="range",
    )
    remote = zstore.WindowDataset(
        s3_store, window_seconds=1.5, seed=2, cache=cache, storage_options=options
    )
    local = zstore.WindowDataset(small_store, window_seconds=1.5, seed=2, cache=False)
    before = counter.chunk_gets()
    for i in range(len(local)):
        a, b = remote[i], local[i]
        assert a["item"] == b["item"] and a["start"] == b["start"]
        assert a["wav"].numpy().tobytes() == b["wav"].numpy().tobytes()
        assert a["act"].numpy().tobytes() == b["act"].numpy().tobytes()
    assert counter.chunk_gets() > before
    assert remote.settle(timeout=120)  # the shards filled behind the reads are in

    # A second process reading the same windows through the same cache: no chunk GETs.
    before = counter.chunk_gets()
    code = (
        "import zstore, sys, json;"
        f"c = zstore.CacheConfig(ram_dir={str(tmp_path / 'ram')!r}, ram_bytes='64MB',"
        f"ssd_dir={str(tmp_path / 'ssd')!r}, ssd_bytes='64MB', fetch='range');"
        f"ds = zstore.WindowDataset({s3_store!r}, window_seconds=1.5, seed=2, cache=c,"
        f"storage_options=json.loads({__import__('json').dumps(options)!r}));"
        "[ds[i] for i in range(len(ds))]"
    )
    subprocess.run([PYTHON, "-c", code], env=subprocess_env(), check=True, timeout=600)
    assert counter.chunk_gets() == before


def test_zarr_api_and_info_on_s3(s3, s3_store, small_store, tmp_path):
    import zarr

    options, _ = s3
    cache = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="16MB", ssd_dir=None)
    group = zarr.open_group(
        zstore.open_store(s3_store, cache=cache, storage_options=options), mode="r"
    )
    local = zarr.open_group(small_store, mode="r")
    np.testing.assert_array_equal(
        group["utt000001/wav"][:, 100:50000], local["utt000001/wav"][:, 100:50000]
    )
    info = zstore.store_info(s3_store, storage_options=options)
    assert info["items"] == 6 and info["arrays"]["wav"]["rate"] == 16000


def test_s3_shard_fetch_and_warm(s3, s3_store, tmp_path):
    options, counter = s3
    cache = zstore.CacheConfig(
        ram_dir=tmp_path / "ram",
        ram_bytes="64MB",
        ssd_dir=tmp_path / "ssd",
        ssd_bytes="64MB",
        fetch="shard",  # auto reads this local endpoint by ranges: its round trip is short
    )
    reader = WindowReader(s3_store, cache=cache, storage_options=options).open()
    assert reader.fetch == "shard"
    before = counter.chunk_gets()
    done = zstore.warm(s3_store, cache=cache, storage_options=options, progress=False)
    assert done["items"] == 6
    assert counter.chunk_gets() - before == 6 * 2  # one GET per shard: 6 items x 2 arrays
    before = counter.chunk_gets()
    ds = zstore.WindowDataset(s3_store, window_seconds=1.0, cache=cache, storage_options=options)
    [ds[i] for i in range(len(ds))]
    assert counter.chunk_gets() == before  # everything was warm


# --- origin faults, through the modelled file system ----------------------------------


def fast_retry(attempts: int = 4) -> RetryPolicy:
    return RetryPolicy(attempts=attempts, first_delay=0.001, max_delay=0.01, deadline=30)


def _reader(small_store, tmp_path, fs):
    # No RAM tier: windows read just their chunks' byte ranges (a RAM tier builds shards)
    cache = zstore.CacheConfig(
        ram_dir=None, ssd_dir=tmp_path / "ssd", ssd_bytes="64MB", fetch="range"
    )
    reader = WindowReader(small_store, cache=cache, origin_fs=fs).open()
    reader.origin.retry = fast_retry()
    return reader


def test_transient_failures_are_retried(small_store, tmp_path):
    fs = ModelledFileSystem()
    reader = _reader(small_store, tmp_path, fs)
    expected = WindowReader(small_store).read("utt000000", {"wav": Span(0, 16000)})["wav"]
    fs.reset_counts()
    fs.fail_next(3, lambda: ConnectionResetError("connection reset by peer"))
    got = reader.read("utt000000", {"wav": Span(0, 16000)})["wav"]
    np.testing.assert_array_equal(got, expected)
    assert fs.data_requests == 3 + 2  # three failures, then the index and the chunk


def test_permanent_errors_are_not_retried(small_store, tmp_path):
    fs = ModelledFileSystem()
    reader = _reader(small_store, tmp_path, fs)
    fs.reset_counts()
    fs.fail_next(1, lambda: PermissionError("403 Forbidden"))
    with pytest.raises(zstore.OriginError, match=r"utt000003/wav/c/0/0 \(last \d+ bytes\).*403"):
        reader.read("utt000003", {"wav": Span(0, 100)})
    assert fs.data_requests == 1


def test_retries_stop_at_the_limit(small_store, tmp_path):
    fs = ModelledFileSystem()
    reader = _reader(small_store, tmp_path, fs)
    fs.fail_next(10, lambda: TimeoutError("read timed out"))
    with pytest.raises(zstore.OriginError, match="after 4 attempts"):
        reader.read("utt000002", {"wav": Span(0, 100)})


def test_truncated_response_is_detected_and_retried(small_store, tmp_path):
    fs = ModelledFileSystem()
    reader = _reader(small_store, tmp_path, fs)
    reader.read("utt000004", {"wav": Span(0, 10)})  # the index, so the next read is a range
    expected = WindowReader(small_store).read("utt000004", {"wav": Span(16000, 32000)})["wav"]
    fs.reset_counts()
    fs.truncate_next(1)
    got = reader.read("utt000004", {"wav": Span(16000, 32000)})["wav"]
    np.testing.assert_array_equal(got, expected)
    assert fs.data_requests == 2


def test_missing_store_is_a_clear_error(tmp_path):
    with pytest.raises(zstore.StoreFormatError, match="no such directory"):
        zstore.WindowDataset(str(tmp_path / "nothing.zarr"), cache=False)
    (tmp_path / "empty.zarr").mkdir()  # there, but no store in it
    with pytest.raises(zstore.StoreFormatError, match="no zarr.json"):
        zstore.WindowDataset(str(tmp_path / "empty.zarr"), cache=False)
    with pytest.raises(zstore.StoreFormatError, match="no zarr.json"):  # named by its URL
        zstore.open_store(f"file://{tmp_path / 'empty.zarr'}")


def test_origin_error_names_store_key_and_range(tmp_path):
    (tmp_path / "obj").write_bytes(b"x" * 10)
    fs = ModelledFileSystem()
    origin = Origin(str(tmp_path), fs=fs, retry=fast_retry(2))
    assert origin.read("obj", 2, 5) == b"xxx"
    fs.truncate_next(5)
    with pytest.raises(zstore.OriginError) as err:
        origin.read("obj", 0, 8)
    assert str(tmp_path) in str(err.value) and "obj bytes [0, 8)" in str(err.value)


def test_network_file_system_paths_are_read_concurrently(tmp_path, monkeypatch):
    for i in range(4):
        (tmp_path / f"k{i}").write_bytes(bytes([i]) * 100)
    local = Origin(str(tmp_path))
    local.read("k0")
    assert not local._concurrent  # local disk: ranges in turn
    monkeypatch.setattr("zstore.urls.filesystem_type", lambda path: "nfs4")
    nfs = Origin(str(tmp_path), max_requests=4)
    assert nfs.read_many([(f"k{i}", 10, 20) for i in range(4)]) == [
        bytes([i]) * 10 for i in range(4)
    ]
    assert nfs._concurrent and nfs._pool is not None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", ["no credentials", "unreachable endpoint"])
def test_conversion_to_s3_that_cannot_be_written_is_one_line(s3, small_h5, tmp_path, case):
    import os

    options, _ = s3
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("AWS_")}
    env.update(
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_ENDPOINT_URL=options["client_kwargs"]["endpoint_url"],
        AWS_DEFAULT_REGION="us-east-1",
        AWS_MAX_ATTEMPTS="2",
    )
    if case == "unreachable endpoint":
        env.update(
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{_free_port()}",
        )
    proc = subprocess.run(
        [
            PYTHON,
            "-m",
            "zstore.cli",
            "convert",
            small_h5,
            "s3://zstore-test/denied.zarr",
            "--rate",
            "wav=16000",
            "--rate",
            "act=100",
            "--no-progress",
            "--workers",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "s3://zstore-test/denied.zarr" in proc.stderr and "credentials" in proc.stderr
    assert os.path.exists(small_h5)


def test_zarr_reads_through_open_store_stop_when_the_s3_store_is_overwritten(s3, tmp_path):
    """The root read beside each origin round of ``open_store`` (a remote store's, in the
    same concurrent round): after an overwrite, chunks not in the tiers raise instead of
    returning the new store's values; a new ``open_store`` reads the new store."""
    import zarr

    options, _ = s3
    url = "s3://zstore-test/overwritten.zarr"
    sources = same_layout_sources(tmp_path, items=3, seconds=20)
    kw = {"rates": {"wav": 16000}, "storage_options": options, "progress": False}
    zstore.convert(sources[0], url, **kw)
    cache = zstore.CacheConfig(ram_dir=None, ram_bytes=0, ssd_dir=tmp_path / "ssd")
    group = zarr.open_group(zstore.open_store(url, cache=cache, storage_options=options), mode="r")
    arrays = [group[f"rec{i}/wav"] for i in range(3)]
    assert round(float(arrays[0][:, :16000].min()) * 32768) == 1000
    zstore.convert(sources[1], url, overwrite=True, **kw)
    refused = 0
    for array in arrays:
        try:
            assert round(float(array[:, :].min()) * 32768) == 1000, "the new store's values"
        except zstore.StoreReplacedError:
            refused += 1
    assert refused > 0
    fresh = zarr.open_group(zstore.open_store(url, cache=cache, storage_options=options), mode="r")
    assert round(float(fresh["rec0/wav"][:, :16000].min()) * 32768) == -2000
