"""Conversion on a Dask distributed cluster: a LocalCluster of 2 worker processes."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr
from conftest import corpus_files, manifest_of, zstore_cli
from distributed import Client, LocalCluster

import zstore
from zstore.errors import ZstoreError


@pytest.fixture(scope="module")
def cluster():
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            host="127.0.0.1",
        ) as c,
        Client(c) as client,
    ):
        yield c, client


def item_files(store: Path) -> dict[str, bytes]:
    """Every object of the store but the root metadata (which holds the store id)."""
    return {
        str(p.relative_to(store)): p.read_bytes()
        for p in sorted(store.rglob("*"))
        if p.is_file()
        and p.relative_to(store) != Path("zarr.json")
        and not p.relative_to(store).parts[0].startswith("zstore_items_")
    }


def test_a_corpus_and_an_append_on_the_cluster_equal_a_local_conversion(tmp_path, cluster):
    _, client = cluster
    corpus_files(tmp_path)
    corpus = tmp_path / "corpus"
    first, later = [corpus / "a.h5", corpus / "b.hdf5"], corpus / "day2" / "c.h5"
    local, remote = tmp_path / "local.zarr", tmp_path / "dask.zarr"
    zstore.convert(first, local, rates={"wav": 16000}, workers=1, progress=False)
    report = zstore.convert(
        first, remote, rates={"wav": 16000}, dask=client, verify=True, progress=False
    )
    assert (report.items, report.converted, report.verified) == (3, 3, True)
    zstore.append(later, local, workers=1, progress=False)
    added = zstore.append(later, remote, dask=client, verify=True, progress=False)
    assert (added.items, added.converted) == (4, 1)
    a, b = item_files(local), item_files(remote)
    assert a.keys() == b.keys() and len(a) >= 10  # packed: shards, records, metadata
    assert all(a[k] == b[k] for k in a), [k for k in a if a[k] != b[k]]
    ma, mb = manifest_of(local), manifest_of(remote)
    assert list(ma.items) == list(mb.items)
    assert all(np.array_equal(ma.shapes[n], mb.shapes[n]) for n in ma.arrays)
    ds = zstore.WindowDataset(remote, window_seconds=1.0, cache=False)
    assert len(ds) == 4


def _corrupt_first_chunk(path: Path, dataset: str) -> tuple[int, bytes]:
    with h5py.File(path, "r") as f:
        info = f[dataset].id.get_chunk_info(0)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset)
        good = fh.read(info.size)
        fh.seek(info.byte_offset)
        fh.write(b"\xff" * info.size)
    return info.byte_offset, good


def test_a_failed_item_is_named_and_a_rerun_resumes_on_the_cluster(tmp_path, cluster):
    c, client = cluster
    rng = np.random.default_rng(4)
    src = tmp_path / "gz.h5"
    with h5py.File(src, "w") as f:
        for k in range(4):
            g = f.create_group(f"rec{k}")
            g.create_dataset(
                "wav",
                data=rng.standard_normal((1, 32000)).astype(np.float32),
                chunks=(1, 8000),
                compression="gzip",
            )
    st = os.stat(src)
    offset, good = _corrupt_first_chunk(src, "rec2/wav")
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))  # a transient fault: same file
    dst = tmp_path / "s.zarr"
    proc = zstore_cli(
        "convert",
        str(src),
        str(dst),
        "--rate",
        "wav=16000",
        "--dask",
        c.scheduler_address,
        "--no-progress",
        "--pack-seconds",  # item by item (a packed batch fails and resumes whole)
        "0",
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "rec2/wav" in last and "Traceback" not in proc.stderr
    # The failure cancels the tasks not started; one already running finishes on its
    # worker. A task queued behind it on each (one-thread) worker returns once it has,
    # and then the items marked complete are the ones kept.
    behind = [
        client.submit(int, pure=False, workers=[w]) for w in client.scheduler_info()["workers"]
    ]
    client.gather(behind)
    done = [k for k in range(4) if "zstore_complete" in _text(dst / f"rec{k}" / "zarr.json")]
    assert 2 not in done
    with open(src, "r+b") as fh:  # the fault clears
        fh.seek(offset)
        fh.write(good)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    proc = zstore_cli(
        "convert",
        str(src),
        str(dst),
        "--rate",
        "wav=16000",
        "--dask",
        c.scheduler_address,
        "--verify",
        "--no-progress",
        "--pack-seconds",
        "0",
    )
    assert proc.returncode == 0, proc.stderr
    assert f"{len(done)} already done" in proc.stdout and "verified" in proc.stdout
    with h5py.File(src, "r") as f:
        root = zarr.open_group(dst, mode="r")
        for k in range(4):
            assert np.array_equal(root[f"rec{k}/wav"][...], f[f"rec{k}/wav"][()])


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_bad_cluster_addresses(tmp_path, small_h5):
    import dask
    from conftest import free_port

    with (
        pytest.raises(ZstoreError, match="cannot reach the scheduler"),
        dask.config.set({"distributed.comm.timeouts.connect": "2s"}),
    ):
        zstore.convert(
            small_h5,
            tmp_path / "x.zarr",
            rates={"wav": 16000},
            dask=f"tcp://127.0.0.1:{free_port()}",
            progress=False,
        )
    with pytest.raises(ZstoreError, match="scheduler address"):
        zstore.convert(small_h5, tmp_path / "y.zarr", rates={"wav": 16000}, dask=5, progress=False)
    assert not (tmp_path / "x.zarr").exists()  # nothing written before connecting


def test_workers_with_several_threads_get_a_warning(tmp_path, small_h5):
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None
        ) as c,
        Client(c) as client,
    ):
        with pytest.warns(UserWarning, match="--nthreads 1"):
            report = zstore.convert(
                small_h5,
                tmp_path / "t.zarr",
                rates={"wav": 16000},
                dask=client,
                progress=False,
                verify=True,
            )
    assert report.verified and report.converted == report.items


@pytest.mark.parametrize("pack_seconds", [0.0, 10.0], ids=["own groups", "packed"])
def test_dataset_items_and_a_cast_on_the_cluster(tmp_path, cluster, pack_seconds):
    _, client = cluster
    rng = np.random.default_rng(6)
    wavs = {f"utt{i}": rng.standard_normal((1, 16000 * (2 + i))) * 0.1 for i in range(3)}
    with h5py.File(tmp_path / "flat.h5", "w") as f:  # float64 recordings, one dataset each
        for name, wav in wavs.items():
            f[name] = wav
    report = zstore.convert(
        tmp_path / "flat.h5",
        tmp_path / "s.zarr",
        rates={"wav": 16000},
        dataset_items="wav",
        dtypes={"wav": "float32"},
        pack_seconds=pack_seconds,
        dask=client,
        verify=True,
        progress=False,
    )
    assert report.items == 3 and report.verified
    ds = zstore.WindowDataset(tmp_path / "s.zarr", window_seconds=None, cache=False)
    for i in range(len(ds)):
        x = ds[i]
        np.testing.assert_array_equal(x["wav"].numpy(), wavs[x["item"]].astype(np.float32))
