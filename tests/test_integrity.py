"""Never wrong data, part two: the store's files and the tiers' files changed under a
running job, damaged tier values found by one process, files rewritten with their size and
time kept, and arguments that used to be taken the wrong way."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

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
def test_a_local_file_rewritten_with_its_size_and_mtime_kept_is_not_served_stale(tmp_path,
                                                                                   how):
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
