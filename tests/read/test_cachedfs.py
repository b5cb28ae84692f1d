"""zstore's tiers as an fsspec caching layer, on a real local S3 server (moto + s3fs)."""

from __future__ import annotations

import hashlib
import os

import fsspec
import h5py
import numpy as np
import pytest
import zarr

import zstore
from zstore.testing import spawn_ranks

BUCKET = "zstore-test"


@pytest.fixture(scope="module")
def h5_on_s3(s3, small_h5):
    options, _ = s3
    fs = fsspec.filesystem("s3", **options)
    fs.put_file(small_h5, f"{BUCKET}/corpus.h5")
    return f"{BUCKET}/corpus.h5"


def cached(tmp_path, options, **kw):
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=tmp_path / "ssd", ssd_bytes="64MB"
    )
    return zstore.cached_filesystem(
        "s3://", storage_options=options, cache=cfg, block_size="64KiB", **kw
    ), cfg


def h5_digest(f) -> str:
    digest = hashlib.sha256()
    with h5py.File(f, "r") as h5:
        names: list[str] = []
        h5.visititems(
            lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None
        )
        for name in names:  # read after the visit: h5py holds its lock through a visit
            digest.update(name.encode())
            digest.update(np.ascontiguousarray(h5[name][()]).tobytes())
    return digest.hexdigest()


def test_read_cat_file_and_h5py_are_bit_identical(s3, h5_on_s3, small_h5, tmp_path):
    options, counter = s3
    fs, cfg = cached(tmp_path, options)
    whole = open(small_h5, "rb").read()
    with fs.open(h5_on_s3) as f:
        assert f.read() == whole
    assert fs.cat_file(h5_on_s3, start=1000, end=200_000) == whole[1000:200_000]
    assert fs.cat_file(h5_on_s3, start=-100) == whole[-100:]
    with fs.open(h5_on_s3) as f:
        assert h5_digest(f) == h5_digest(small_h5)
    before = len(counter.requests)
    with fs.open(h5_on_s3) as f:  # all from the tiers now: only the metadata request
        assert f.read() == whole
    gets = [r for r in counter.requests[before:] if r[0] == "GET"]
    assert len(gets) == 0
    stats = zstore.cache_stats(cfg)
    assert stats["ram"]["hits"] > 0 and stats["origin"]["bytes"] >= len(whole)
    assert fs.exists(h5_on_s3) and not fs.exists(f"{BUCKET}/nothing.h5")
    assert any(p.endswith("corpus.h5") for p in fs.ls(BUCKET, detail=False))


def _h5_reader(options, path, ram, ssd, barrier, queue):
    cfg = zstore.CacheConfig(ram_dir=ram, ram_bytes="64MB", ssd_dir=ssd, ssd_bytes="64MB")
    fs = zstore.cached_filesystem("s3://", storage_options=options, cache=cfg, block_size="64KiB")
    barrier.wait()
    with fs.open(path) as f:
        queue.put(h5_digest(f))


def test_four_processes_read_hdf5_through_one_cache(s3, h5_on_s3, small_h5, tmp_path):
    options, _ = s3
    ram, ssd = str(tmp_path / "ram"), str(tmp_path / "ssd")
    digests = spawn_ranks(_h5_reader, 4, lambda r, b, q: (options, h5_on_s3, ram, ssd, b, q))
    assert set(digests) == {h5_digest(small_h5)}
    cfg = zstore.CacheConfig(ram_dir=ram, ram_bytes="64MB", ssd_dir=ssd, ssd_bytes="64MB")
    size = os.path.getsize(small_h5)
    # every block came from S3 once for the node, not once per process
    assert zstore.cache_stats(cfg)["origin"]["bytes"] <= size + 64 * 1024


def test_fsspec_open_with_a_chained_url(s3, h5_on_s3, small_h5, tmp_path):
    options, _ = s3
    with fsspec.open(
        f"zstore::s3://{h5_on_s3}",
        s3=options,
        zstore={
            "ram_dir": str(tmp_path / "ram"),
            "ram_bytes": "64MB",
            "ssd_dir": str(tmp_path / "ssd"),
            "ssd_bytes": "64MB",
        },
    ) as f:
        assert f.read() == open(small_h5, "rb").read()


def test_zarr_opens_a_store_through_it(s3, small_store, tmp_path):
    options, _ = s3
    raw = fsspec.filesystem("s3", **options)
    raw.put(small_store, f"{BUCKET}/plain.zarr", recursive=True)
    fs, _ = cached(tmp_path, options)
    from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
    from zarr.storage import FsspecStore

    store = FsspecStore(fs=AsyncFileSystemWrapper(fs), path=f"{BUCKET}/plain.zarr", read_only=True)
    group = zarr.open_group(store, mode="r")
    local = zarr.open_group(small_store, mode="r")
    np.testing.assert_array_equal(
        group["utt000001/wav"][:, :5000], local["utt000001/wav"][:, :5000]
    )


def test_a_changed_file_is_never_served_stale(s3, tmp_path):
    options, _ = s3
    raw = fsspec.filesystem("s3", **options)
    path = f"{BUCKET}/changing.bin"
    raw.pipe_file(path, b"a" * 200_000)
    fs, _ = cached(tmp_path, options)
    assert fs.cat_file(path) == b"a" * 200_000
    raw.pipe_file(path, b"b" * 200_000)  # same size, new ETag
    fs.fs.invalidate_cache()
    assert fs.cat_file(path) == b"b" * 200_000


def test_stale_if_error_serves_cached_blocks(s3, tmp_path):
    options, _ = s3
    raw = fsspec.filesystem("s3", **options)
    path = f"{BUCKET}/outage.bin"
    data = os.urandom(300_000)
    raw.pipe_file(path, data)
    fs, _ = cached(tmp_path, options)
    assert fs.cat_file(path, start=0, end=100_000) == data[:100_000]
    dead = dict(
        options,
        client_kwargs={**options["client_kwargs"], "endpoint_url": "http://127.0.0.1:9"},
        config_kwargs={"connect_timeout": 1, "retries": {"max_attempts": 1}},
    )
    outage, _ = cached(tmp_path, dead)  # the same tiers, an origin that cannot be reached
    with pytest.warns(UserWarning, match="cannot be reached.*stale-if-error"):
        assert outage.cat_file(path, start=0, end=100_000) == data[:100_000]
    with pytest.raises(Exception):  # noqa: B017 - any failure: a block never cached cannot be served
        outage.cat_file(path, start=200_000, end=300_000)


def test_read_only(s3, h5_on_s3, tmp_path):
    options, _ = s3
    fs, _ = cached(tmp_path, options)
    with pytest.raises(ValueError, match="read-only"):
        fs.open(h5_on_s3, "wb")
