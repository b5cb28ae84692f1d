"""Shared nodes: a tier belongs to its user (or, opted in, to one group), and a tier
directory anyone else can write is refused, never used."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import stat
import tempfile
from pathlib import Path

import numpy as np
import pytest

import zstore
from zstore.cache import TieredCache

from test_cli import zstore_cli

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown and setuid")


def windows(ds) -> list[bytes]:
    return [ds[i]["wav"].numpy().tobytes() for i in range(len(ds))]


def modes(directory: Path) -> tuple[set[int], set[int]]:
    dirs, files = {stat.S_IMODE(directory.stat().st_mode)}, set()
    for path in directory.rglob("*"):
        (dirs if path.is_dir() else files).add(stat.S_IMODE(path.lstat().st_mode))
    return dirs, files


def test_default_directories_are_per_user():
    resolved = zstore.CacheConfig().resolved()
    if resolved.ram_dir:
        assert resolved.ram_dir == f"/dev/shm/zstore-{os.getuid()}"
    assert resolved.ssd_dir.startswith(os.environ["XDG_CACHE_HOME"])


def test_tiers_are_created_private(small_store, tmp_path):
    cfg = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="64MB",
                             ssd_dir=tmp_path / "ssd", ssd_bytes="64MB")
    old = os.umask(0)  # the loosest umask: modes must not depend on it
    try:
        ds = zstore.WindowDataset(small_store, window_seconds=2.0, cache=cfg)
        got = windows(ds)
    finally:
        os.umask(old)
    assert got == windows(zstore.WindowDataset(small_store, window_seconds=2.0, cache=False))
    for tier in ("ram", "ssd"):
        dirs, files = modes(tmp_path / tier)
        assert dirs == {0o700}, (tier, [oct(m) for m in dirs])
        assert files and files <= {0o600}, (tier, [oct(m) for m in files])


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "another user"])
def test_a_tier_others_can_write_is_refused(small_store, tmp_path, how):
    ram = tmp_path / "ram"
    ram.mkdir()
    if how == "world-writable":
        ram.chmod(0o777)
    elif how == "group-writable":
        ram.chmod(0o770)
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to chown")
        os.chown(ram, 65534, 65534)
        ram.chmod(0o700)
    cfg = zstore.CacheConfig(ram_dir=ram, ram_bytes="64MB", ssd_dir=None)
    with pytest.warns(UserWarning, match="ram tier refused") as caught:
        ds = zstore.WindowDataset(small_store, window_seconds=2.0, cache=cfg)
        got = windows(ds)
    message = str(caught[0].message)
    assert str(ram) in message and "mode" in message and "owner" in message
    assert got == windows(zstore.WindowDataset(small_store, window_seconds=2.0, cache=False))
    assert list(ram.iterdir()) == []  # nothing was written into it
    text = zstore_cli("cache", "stats", "--ram-dir", str(ram), "--ram-bytes", "64MB",
                      "--ssd-dir", "none")
    assert "REFUSED" in text.stdout and "mode" in text.stdout


def test_a_refused_ram_tier_leaves_the_ssd_tier_working(small_store, tmp_path):
    ram = tmp_path / "ram"
    ram.mkdir()
    ram.chmod(0o777)
    cfg = zstore.CacheConfig(ram_dir=ram, ram_bytes="64MB", ssd_dir=tmp_path / "ssd",
                             ssd_bytes="64MB")
    with pytest.warns(UserWarning, match="refused"):
        cache = TieredCache(cfg.resolved(), "n")
    assert cache.ram is None and cache.ssd is not None
    assert cache.get("k", lambda: b"value") == b"value"
    assert list(ram.iterdir()) == []


def test_cache_stats_shows_directory_owner_and_mode(small_store, tmp_path):
    dirs = ["--ram-dir", str(tmp_path / "ram"), "--ram-bytes", "64MB",
            "--ssd-dir", str(tmp_path / "ssd"), "--ssd-bytes", "64MB"]
    assert zstore_cli("cache", "warm", small_store, "--no-progress", *dirs).returncode == 0
    text = zstore_cli("cache", "stats", *dirs).stdout
    assert "mode 0700" in text and "owner" in text and str(tmp_path / "ram") in text
    assert "REFUSED" not in text


def test_unknown_shared_group_is_a_config_error(tmp_path):
    with pytest.raises(zstore.ConfigError, match="no group 'no-such-group-zz'"):
        zstore.CacheConfig(ram_dir=tmp_path / "r", shared_group="no-such-group-zz").resolved()


GID = 48213  # a group only this test uses


def _member(uid: int, store: str, ram: str, queue) -> None:
    """A process of another user in the shared group: read windows through the tier."""
    try:
        os.setgroups([GID])
        os.setgid(GID)
        os.setuid(uid)
        cfg = zstore.CacheConfig(ram_dir=ram, ram_bytes="64MB", ssd_dir=None,
                                 shared_group=GID)
        ds = zstore.WindowDataset(store, window_seconds=2.0, cache=cfg)
        got = windows(ds)
        queue.put((uid, got, zstore.cache_stats(cfg)["ram"]["hits"], None))
    except BaseException as e:  # report, do not hang the parent
        queue.put((uid, None, 0, repr(e)))


@root_only
def test_a_shared_group_serves_two_users(small_h5):
    base = Path(tempfile.mkdtemp(prefix="zstore-group-", dir="/tmp"))
    try:
        base.chmod(0o755)  # the store is readable by the group's members
        store = base / "s.zarr"
        zstore.convert(small_h5, store, rates={"wav": 16000, "act": 100}, workers=1,
                       progress=False)
        shared = base / "shared"
        shared.mkdir()
        os.chown(shared, 0, GID)
        shared.chmod(0o2770)
        ram = shared / "ram"
        ctx = mp.get_context("fork")  # setuid after the imports: the venv may be private
        queue = ctx.Queue()
        results = []
        for uid in (61001, 61002):  # one after the other: the second reads what the first filled
            p = ctx.Process(target=_member, args=(uid, str(store), str(ram), queue))
            p.start()
            results.append(queue.get(timeout=300))
            p.join(timeout=300)
        expected = windows(zstore.WindowDataset(store, window_seconds=2.0, cache=False))
        for uid, got, hits, error in results:
            assert error is None, error
            assert got == expected
        assert results[1][2] > results[0][2]  # the second user hit what the first cached
        st = ram.stat()
        assert st.st_gid == GID and stat.S_IMODE(st.st_mode) == 0o2770
        dirs, files = modes(ram)
        assert dirs == {0o2770} and files <= {0o660}
        owners = {p.stat().st_uid for p in ram.rglob("*") if p.is_file()}
        assert owners >= {61001}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_shared_group_opt_in_rejects_a_world_writable_directory(small_store, tmp_path):
    ram = tmp_path / "ram"
    ram.mkdir()
    os.chown(ram, -1, os.getegid())
    ram.chmod(0o2777)
    cfg = zstore.CacheConfig(ram_dir=ram, ram_bytes="64MB", ssd_dir=None,
                             shared_group=os.getegid())
    with pytest.warns(UserWarning, match="anyone"):
        ds = zstore.WindowDataset(small_store, window_seconds=2.0, cache=cfg)
        assert np.array_equal(ds[0]["wav"].numpy(),
                              zstore.WindowDataset(small_store, window_seconds=2.0,
                                                   cache=False)[0]["wav"].numpy())
    assert list(ram.iterdir()) == []
