"""Never wrong data, part two: the store's files and the tiers' files changed under a
running job, damaged tier values found by one process, files rewritten with their size and
time kept, and arguments that used to be taken the wrong way."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import pytest
from conftest import same_layout_sources

import zstore


def test_a_negative_index_is_refused_not_wrapped(small_store):
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=False)
    with pytest.raises(IndexError, match="-1 out of range"):
        ds[-1]
    assert ds[len(ds) - 1]["length"] > 0


def test_an_items_callable_that_raises_is_named(small_store):
    def choose(name, attrs):
        return attrs["missing"] > 0

    with pytest.raises(zstore.ConfigError, match="items= callable raised KeyError") as e:
        zstore.WindowDataset(small_store, window_seconds=1.0, cache=False, items=choose)
    assert "utt000000" in str(e.value)


@pytest.mark.parametrize("how", ["cp -p", "rsync -a"])
def test_a_local_file_rewritten_with_its_size_and_mtime_kept_is_not_served_stale(tmp_path, how):
    import fsspec

    path = tmp_path / "corpus.bin"
    path.write_bytes(b"a" * 300_000)
    cfg = dict(ram_dir=str(tmp_path / "ram"), ram_bytes="16MB", ssd_dir="none")
    url = f"zstore::file://{path}"
    with fsspec.open(url, "rb", zstore=cfg) as f:
        assert f.read() == b"a" * 300_000
    st = os.stat(path)
    other = tmp_path / "other.bin"
    other.write_bytes(b"b" * 300_000)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    if how == "cp -p":  # in place: same inode, size and mtime; only the ctime moves
        subprocess.run(["cp", "-p", str(other), str(path)], check=True)
    else:  # a new file renamed over the old one, its mtime restored
        tmp = tmp_path / ".corpus.bin.tmp"
        shutil.copy2(other, tmp)
        os.replace(tmp, path)
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    fs = zstore.cached_filesystem("file", cache=zstore.CacheConfig(**cfg))
    with fs.open(str(path), "rb") as f:
        assert f.read() == b"b" * 300_000
    with fsspec.open(url, "rb", zstore=cfg) as f:
        assert f.read() == b"b" * 300_000


TRUNCATE = """
import glob, os, sys
import numpy as np
import zstore

store, ram, cut = sys.argv[1], sys.argv[2], float(sys.argv[3])
cache = zstore.CacheConfig(ram_dir=ram, ram_bytes="64MB", ssd_dir=None) if ram != "-" \\
    else False
ds = zstore.WindowDataset(store, window_seconds=1.0, cache=cache)
before = [(ds[i]["wav"].numpy().copy(), int(ds[i]["length"])) for i in range(len(ds))]
table, = glob.glob(os.path.join(store, "zstore_items_*", "c", "0"))
with open(table, "r+b") as f:  # an interrupted cp over the store: cut short in place
    f.truncate(int(os.path.getsize(table) * cut))
after = [(ds[i]["wav"].numpy(), int(ds[i]["length"])) for i in range(len(ds))]
assert all(np.array_equal(a[0], b[0]) and a[1] == b[1] > 0 for a, b in zip(before, after))
print("same windows", len(after))
"""


@pytest.mark.parametrize("cut", [0.5, 0.0])
@pytest.mark.parametrize("tier", ["ram", "none"])
def test_the_item_table_truncated_under_a_running_job(small_store, tmp_path, cut, tier):
    from conftest import PYTHON, subprocess_env

    store = tmp_path / "s.zarr"
    shutil.copytree(small_store, store)
    script = tmp_path / "job.py"
    script.write_text(TRUNCATE)
    ram = str(tmp_path / "ram") if tier == "ram" else "-"
    proc = subprocess.run(
        [PYTHON, str(script), str(store), ram, str(cut)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])  # -7: SIGBUS
    assert "same windows 6" in proc.stdout
    with pytest.raises(zstore.StoreFormatError, match="item table"):  # a new job refuses
        zstore.WindowDataset(store, window_seconds=1.0, cache=False)


def _flip(path, at: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_damaged_node_copy_of_the_item_table_is_made_anew(s3, small_h5, tmp_path):
    options, _ = s3
    url = "s3://zstore-test/table-copy.zarr"
    zstore.convert(
        small_h5,
        url,
        rates={"wav": 16000, "act": 100},
        storage_options=options,
        workers=1,
        progress=False,
    )
    cfg = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=None)
    expected = [
        zstore.WindowDataset(url, window_seconds=1.0, cache=False, storage_options=options)[i][
            "wav"
        ]
        for i in range(6)
    ]
    zstore.WindowDataset(url, window_seconds=1.0, cache=cfg, storage_options=options)
    (copy,) = (tmp_path / "ram").rglob("tables/*zstore_items_*")
    _flip(copy)
    ds = zstore.WindowDataset(url, window_seconds=1.0, cache=cfg, storage_options=options)
    assert all(ds[i]["wav"].equal(expected[i]) for i in range(6))
    (again,) = (tmp_path / "ram").rglob("tables/*zstore_items_*")
    from zstore.format._table import MAGIC  # the copy was replaced by a good one

    assert again.read_bytes().startswith(MAGIC)
    zstore.WindowDataset(url, window_seconds=1.0, cache=cfg, storage_options=options)


@contextlib.contextmanager
def small_tmpfs(path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` for the test (root on Linux only: mount
    needs it; elsewhere the test is skipped), unmounted lazily after it (maps may remain)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    path.mkdir(mode=0o700)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_node_copy_of_the_item_table_that_cannot_be_written_is_a_warning(small_store, tmp_path):
    with small_tmpfs(tmp_path / "ram", "4k") as ram:
        fd = os.open(ram / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:  # another process filled the tmpfs
            with pytest.raises(OSError):
                while True:
                    os.write(fd, b"x" * 512)
        finally:
            os.close(fd)
        cfg = zstore.CacheConfig(ram_dir=ram, ram_bytes="1MB", ssd_dir=None)
        with pytest.warns(UserWarning, match="item table in its own memory"):
            ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=cfg)
        plain = zstore.WindowDataset(small_store, window_seconds=1.0, cache=False)
        assert all(ds[i]["wav"].equal(plain[i]["wav"]) for i in range(len(ds)))


FILL_TMPFS = """
import os, sys, warnings
import zstore

store, ram = sys.argv[1], sys.argv[2]
warnings.simplefilter("ignore")
cfg = zstore.CacheConfig(ram_dir=ram, ram_bytes="2GB", ram_format="encoded", ssd_dir=None)
ds = zstore.WindowDataset(store, window_seconds=0.5, cache=cfg, windows_per_item=40)
plain = zstore.WindowDataset(store, window_seconds=0.5, cache=False, windows_per_item=40)
assert ds[0]["wav"].equal(plain[0]["wav"])
fd = os.open(os.path.join(ram, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
try:  # another process fills the tmpfs while this one reads
    while True:
        os.write(fd, b"x" * 4096)
except OSError:
    pass
for epoch in range(3):
    ds.set_epoch(epoch)
    plain.set_epoch(epoch)
    assert all(ds[i]["wav"].equal(plain[i]["wav"]) for i in range(len(ds)))
print("read", 3 * len(ds))
"""


def test_a_tmpfs_filled_under_a_running_reader_is_no_sigbus(small_store, tmp_path):
    from conftest import PYTHON, subprocess_env

    with small_tmpfs(tmp_path / "ram", "24m") as ram:
        script = tmp_path / "job.py"
        script.write_text(FILL_TMPFS)
        proc = subprocess.run(
            [PYTHON, str(script), small_store, str(ram)],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])  # -7: SIGBUS
        assert "read 720" in proc.stdout


def _largest_value(directory) -> "os.PathLike":
    files = [p for p in directory.rglob("*.val")] or [
        p for p in directory.rglob("*") if p.is_file() and p.suffix not in (".db", ".bin")
    ]
    return max(files, key=lambda p: p.stat().st_size)


def _whole_items(store, cache):
    ds = zstore.WindowDataset(store, window_seconds=None, cache=cache)
    return [ds[i]["wav"].numpy().tobytes() for i in range(len(ds))]


@pytest.mark.parametrize("form", ["decoded", "encoded"])
def test_a_damaged_ram_shard_found_by_one_reader_is_dropped_for_every_reader(
    small_store, tmp_path, form
):
    """Readers that checked a shard's blocks before it was damaged keep no stale map
    once any reader finds the damage (the drop is in the eviction log), and a damaged
    encoded shard is dropped and its chunk read from the origin, not an error."""
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="256MB", ssd_dir=None, ram_format=form
    )
    expected = _whole_items(small_store, False)
    first = zstore.WindowDataset(small_store, window_seconds=None, cache=cfg)
    for _ in range(2):  # built, then mapped and its blocks checked by this reader
        assert [first[i]["wav"].numpy().tobytes() for i in range(len(first))] == expected
        assert first.settle(timeout=120)  # the shards filled behind the reads are in
    victim = _largest_value(tmp_path / "ram")
    size = victim.stat().st_size
    for at in range(size // 3, size - 64, size // 7):  # flips across the payload
        _flip(victim, at)
    if form == "decoded":  # another reader, which checks the blocks afresh, finds it
        assert _whole_items(small_store, cfg) == expected
    for _ in range(2):  # the first reader unmaps the damaged shard: right values, no error
        assert [first[i]["wav"].numpy().tobytes() for i in range(len(first))] == expected
    assert zstore.cache_stats(cfg)["ram"]["corrupt"] >= 1
    assert _whole_items(small_store, cfg) == expected


def _store_of_a(tmp_path):
    """b.h5 of :func:`same_layout_sources`, and a store converted from a.h5."""
    a, b = same_layout_sources(tmp_path)
    store = tmp_path / "s.zarr"
    zstore.convert(a, store, rates={"wav": 16000}, progress=False)
    return b, store


@pytest.mark.parametrize("tier", ["none", "ram, a tenth of the store", "ram, all of it"])
def test_a_store_overwritten_under_a_running_job_never_gives_the_new_values(tmp_path, tier):
    # The job kept its manifest and its tiers' shard indexes, and read the new store's
    # objects: windows of both stores, mixed, without an error.
    b, store = _store_of_a(tmp_path)
    cache = (
        False
        if tier == "none"
        else zstore.CacheConfig(  # decoded: the encoded store (~90 KB) would fit whole
            ram_dir=tmp_path / "ram",
            ram_bytes="400KB" if "tenth" in tier else "64MB",
            ram_format="decoded",
        )
    )
    ds = zstore.WindowDataset(store, window_seconds=1.0, cache=cache, windows_per_item=8)
    for i in range(len(ds)):  # the job's first epoch, its tier filled behind it
        assert round(float(ds[i]["wav"].min()) * 32768) == 1000
    assert ds.settle(timeout=120)
    zstore.convert(b, store, rates={"wav": 16000}, progress=False, overwrite=True)
    served, refused = 0, 0
    for i in range(len(ds)):
        try:
            low = round(float(ds[i]["wav"].min()) * 32768)
        except zstore.StoreReplacedError as e:
            assert "replaced while this job read it" in str(e) and "restart the job" in str(e)
            refused += 1
            continue
        assert low == 1000, f"window {i} holds the new store's values"
        served += 1
    assert (served, refused) == (len(ds), 0) if tier == "ram, all of it" else refused > 0
    fresh = zstore.WindowDataset(store, window_seconds=1.0, cache=cache)
    assert round(float(fresh[0]["wav"].min()) * 32768) == -2000  # a new job reads the new store


def test_an_append_under_a_running_job_is_not_a_replacement(tmp_path):
    import h5py
    import numpy as np

    _, store = _store_of_a(tmp_path)
    ds = zstore.WindowDataset(store, window_seconds=1.0, cache=False, windows_per_item=4)
    first = [ds[i]["wav"].numpy().copy() for i in range(0, len(ds), 2)]
    with h5py.File(tmp_path / "more.h5", "w") as f:
        f["new0/wav"] = np.zeros((1, 16000 * 5), np.float32)
    zstore.append(str(tmp_path / "more.h5"), store, progress=False)
    again = [ds[i]["wav"].numpy() for i in range(0, len(ds), 2)]  # the root was rewritten
    assert all(np.array_equal(x, y) for x, y in zip(first, again))
    assert len(ds) == 16  # the view it opened


@pytest.mark.parametrize("pack_seconds", [0.0, 10.0], ids=["own groups", "packed"])
def test_labels_of_a_store_overwritten_under_a_running_job_are_never_the_new_ones(
    tmp_path, pack_seconds
):
    # a scalar label is read past the chunk rounds: through zarr for an item's own group,
    # from its batch's record for a packed item (40 items of 8 s: two records)
    import h5py
    import numpy as np

    paths = []
    for name, base in (("a.h5", 0), ("b.h5", 100)):
        with h5py.File(tmp_path / name, "w") as f:
            for i in range(40):
                f[f"u{i:02d}/wav"] = np.zeros((1, 16000 * 8), np.float32)
                f[f"u{i:02d}/label"] = np.int64(base + i)
        paths.append(str(tmp_path / name))
    store = tmp_path / "s.zarr"
    kw = dict(rates={"wav": 16000}, progress=False, pack_seconds=pack_seconds)
    zstore.convert(paths[0], store, **kw)
    ds = zstore.WindowDataset(store, window_seconds=None, fields=["label"], cache=False)
    assert int(ds[0]["label"]) == 0
    zstore.convert(paths[1], store, overwrite=True, **kw)
    refused = 0
    for i in range(len(ds)):
        try:
            label = int(ds[i]["label"])
        except zstore.StoreReplacedError:
            refused += 1
            continue
        assert label < 100, f"item {i} got the new store's label {label}"
    assert refused > 0


@pytest.mark.parametrize("tier", ["none", "ssd"])
def test_a_store_overwritten_under_zarr_reads_through_open_store_never_gives_the_new_values(
    tmp_path, tier
):
    # zarr's own API through zstore.open_store: the same check as the reader's rounds
    import zarr

    b, store = _store_of_a(tmp_path)
    cache = (
        False
        if tier == "none"
        else zstore.CacheConfig(ram_dir=None, ram_bytes=0, ssd_dir=tmp_path / "ssd")
    )
    group = zarr.open_group(zstore.open_store(store, cache=cache), mode="r")
    arrays = {f"rec{i}": group[f"rec{i}/wav"] for i in range(4)}
    assert round(float(arrays["rec0"][:, :16000].min()) * 32768) == 1000
    zstore.convert(b, store, rates={"wav": 16000}, progress=False, overwrite=True)
    served, refused = 0, 0
    for name, array in arrays.items():
        try:
            low = round(float(array[:, :].min()) * 32768)
        except zstore.StoreReplacedError as e:
            assert "replaced while this job read it" in str(e)
            refused += 1
            continue
        assert low == 1000, f"{name} holds the new store's values"
        served += 1
    assert refused > 0
    fresh = zarr.open_group(zstore.open_store(store, cache=cache), mode="r")
    assert round(float(fresh["rec0/wav"][:, :16000].min()) * 32768) == -2000


@pytest.mark.parametrize("state", ["removed", "being rewritten", "damaged"])
def test_a_store_caught_mid_overwrite_is_named_as_replaced_not_damaged(tmp_path, state):
    """A job whose first read of a shard comes while a conversion with ``--overwrite``
    has wiped the store (its objects gone) or is rewriting it (a shard cut short, the
    root rewritten first): its shard-index round reads no root beside it, so the job
    said "the store is damaged ... restore the object" (MissingDataError, IntegrityError;
    found by a reader running beside 1,000 overwrites).  The root is checked before
    such an error: the store was replaced, restart the job.  A shard cut short in a
    store whose root is unchanged is still damage."""
    import json
    import shutil

    _, store = _store_of_a(tmp_path)
    ds = zstore.WindowDataset(store, window_seconds=1.0, cache=False)  # no shard read yet
    shard = store / "rec0" / "wav" / "c" / "0" / "0"
    if state == "removed":
        shutil.rmtree(store)
    else:
        shard.write_bytes(b"")  # a shard object as an overwrite leaves it mid-write
    if state == "being rewritten":  # the overwrite's new root, with its progress mark
        meta = json.loads((store / "zarr.json").read_text())
        meta["attributes"] = {"zstore_convert": {"sources": [], "options": {}}}
        (store / "zarr.json").write_text(json.dumps(meta))
    first = next(i for i in range(len(ds)) if ds.locate(i)[0] == "rec0")
    if state == "damaged":
        with pytest.raises(zstore.IntegrityError, match="shard index"):
            ds[first]
        return
    with pytest.raises(zstore.StoreReplacedError, match="restart the job"):
        ds[first]


def test_a_store_overwritten_while_it_is_opened_is_named_as_replaced(tmp_path):
    """A job (or a DataLoader worker given its parent's view) that read the root of a
    store being overwritten, then found the item table it names gone, was told the
    table is missing and to restore it from a good copy (found by
    tools/random_corpora.py overwrites).  The root is read again: another store there,
    or none finished, is StoreReplacedError."""
    import pickle

    b, store = _store_of_a(tmp_path)
    ds = zstore.WindowDataset(store, window_seconds=1.0, cache=False)
    pickled = pickle.dumps(ds)  # the root's view, as a worker gets it
    zstore.convert(b, store, rates={"wav": 16000}, progress=False, overwrite=True)
    with pytest.raises(zstore.StoreReplacedError, match="replaced while it was opened or read"):
        pickle.loads(pickled)[0]
    table = next(store.glob("zstore_items_*")) / "c" / "0"
    table.unlink()  # the root unchanged: the store is damaged
    with pytest.raises(zstore.StoreFormatError, match="item table is missing; restore"):
        zstore.WindowDataset(store, window_seconds=1.0, cache=False)
