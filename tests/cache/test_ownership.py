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
from conftest import zstore_cli

import zstore
from zstore.cache import TieredCache

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown and setuid")


def windows(ds) -> list[bytes]:
    return [ds[i]["wav"].numpy().tobytes() for i in range(len(ds))]


def modes(directory: Path) -> tuple[set[int], set[int]]:
    dirs, files = {stat.S_IMODE(directory.stat().st_mode)}, set()
    for path in directory.rglob("*"):
        (dirs if path.is_dir() else files).add(stat.S_IMODE(path.lstat().st_mode))
    return dirs, files


def test_default_directories_are_per_user(monkeypatch):
    monkeypatch.delenv("ZSTORE_RAM_DIR")  # conftest points it away from the real tier
    resolved = zstore.CacheConfig().resolved()
    if resolved.ram_dir:
        assert resolved.ram_dir == f"/dev/shm/zstore-{os.getuid()}"
    assert resolved.ssd_dir.startswith(os.environ["XDG_CACHE_HOME"])


def test_tiers_are_created_private(small_store, tmp_path):
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=tmp_path / "ssd", ssd_bytes="64MB"
    )
    old = os.umask(0)  # the loosest umask: modes must not depend on it
    try:
        ds = zstore.WindowDataset(small_store, window_seconds=2.0, cache=cfg)
        got = windows(ds)
        # the fills behind the reads are done: a value file is chmod-ed right after
        # diskcache creates it, and a scan between the two saw the umask's mode
        assert ds.settle(timeout=300)
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
    text = zstore_cli(
        "cache", "stats", "--ram-dir", str(ram), "--ram-bytes", "64MB", "--ssd-dir", "none"
    )
    assert "REFUSED" in text.stdout and "mode" in text.stdout


def test_a_refused_ram_tier_leaves_the_ssd_tier_working(small_store, tmp_path):
    ram = tmp_path / "ram"
    ram.mkdir()
    ram.chmod(0o777)
    cfg = zstore.CacheConfig(
        ram_dir=ram, ram_bytes="64MB", ssd_dir=tmp_path / "ssd", ssd_bytes="64MB"
    )
    with pytest.warns(UserWarning, match="refused"):
        cache = TieredCache(cfg.resolved(), "n")
    assert cache.ram is None and cache.ssd is not None
    assert cache.get("k", lambda: b"value") == b"value"
    assert list(ram.iterdir()) == []


def test_cache_stats_shows_directory_owner_and_mode(small_store, tmp_path):
    dirs = [
        "--ram-dir",
        str(tmp_path / "ram"),
        "--ram-bytes",
        "64MB",
        "--ssd-dir",
        str(tmp_path / "ssd"),
        "--ssd-bytes",
        "64MB",
    ]
    assert zstore_cli("cache", "warm", small_store, "--no-progress", *dirs).returncode == 0
    text = zstore_cli("cache", "stats", *dirs).stdout
    assert "mode 0700" in text and "owner" in text and str(tmp_path / "ram") in text
    assert "REFUSED" not in text


def test_unknown_shared_group_is_a_config_error(tmp_path):
    with pytest.raises(zstore.ConfigError, match="no group 'no-such-group-zz'"):
        zstore.CacheConfig(ram_dir=tmp_path / "r", shared_group="no-such-group-zz").resolved()


@pytest.fixture
def system_group():
    """A group and three users in the system's databases (root only; removed after):
    the shared-group check asks them who is a member."""
    import subprocess
    import uuid

    if os.geteuid() != 0 or not shutil.which("groupadd") or not shutil.which("useradd"):
        pytest.skip("needs root and groupadd/useradd to make a real group")
    tag = uuid.uuid4().hex[:6]
    group, users = f"zsg{tag}", [f"zsu{tag}{k}" for k in range(3)]
    subprocess.run(["groupadd", group], check=True)
    try:
        for user in users:
            subprocess.run(
                ["useradd", "-M", "-N", "-G", group, "-s", "/bin/false", user], check=True
            )
        import grp
        import pwd

        yield (grp.getgrnam(group).gr_gid, [pwd.getpwnam(u).pw_uid for u in users], group, users)
    finally:
        for user in users:
            subprocess.run(["userdel", user], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)


def _member(uid: int, gid: int, store: str, ram: str, queue) -> None:
    """A process of another user in the shared group: read windows through the tier."""
    import warnings

    try:
        os.setgroups([gid])
        os.setgid(gid)
        os.setuid(uid)
        cfg = zstore.CacheConfig(ram_dir=ram, ram_bytes="64MB", ssd_dir=None, shared_group=gid)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds = zstore.WindowDataset(store, window_seconds=2.0, cache=cfg)
            got = windows(ds)
        said = " ".join(str(w.message) for w in caught)
        queue.put((uid, got, zstore.cache_stats(cfg)["ram"]["hits"], None, said))
    except BaseException as e:  # report, do not hang the parent
        queue.put((uid, None, 0, repr(e), ""))


def _shared_base(small_h5: str, gid: int) -> tuple[Path, Path, Path]:
    base = Path(tempfile.mkdtemp(prefix="zstore-group-", dir="/tmp"))
    base.chmod(0o755)  # the store is readable by the group's members
    store = base / "s.zarr"
    zstore.convert(small_h5, store, rates={"wav": 16000, "act": 100}, workers=1, progress=False)
    shared = base / "shared"
    shared.mkdir()
    os.chown(shared, 0, gid)
    shared.chmod(0o2770)
    return base, store, shared / "ram"


def _as_users(uids: list[int], gid: int, store: Path, ram: Path) -> list:
    ctx = mp.get_context("fork")  # setuid after the imports: the venv may be private
    queue = ctx.Queue()
    results = []
    for uid in uids:  # one after the other: the next reads what the one before filled
        p = ctx.Process(target=_member, args=(uid, gid, str(store), str(ram), queue))
        p.start()
        results.append(queue.get(timeout=300))
        p.join(timeout=300)
    return results


@root_only
def test_a_shared_group_serves_two_users(small_h5, system_group):
    gid, uids, _, _ = system_group
    base, store, ram = _shared_base(small_h5, gid)
    try:
        results = _as_users(uids[:2], gid, store, ram)
        expected = windows(zstore.WindowDataset(store, window_seconds=2.0, cache=False))
        for _uid, got, _hits, error, _ in results:
            assert error is None, error
            assert got == expected
        assert results[1][2] > results[0][2]  # the second user hit what the first cached
        st = ram.stat()
        assert st.st_gid == gid and stat.S_IMODE(st.st_mode) == 0o2770
        dirs, files = modes(ram)
        assert dirs == {0o2770} and files <= {0o660}
        owners = {p.stat().st_uid for p in ram.rglob("*") if p.is_file()}
        assert owners >= {uids[0]}
    finally:
        shutil.rmtree(base, ignore_errors=True)


@root_only
def test_a_tier_made_by_a_former_member_of_the_group_is_refused(small_h5, system_group):
    import subprocess

    gid, uids, group, users = system_group
    base, store, ram = _shared_base(small_h5, gid)
    try:
        _as_users([uids[2]], gid, store, ram)  # a member fills the tier (owns its dirs)
        assert ram.stat().st_uid == uids[2]
        subprocess.run(["gpasswd", "-d", users[2], group], check=True, capture_output=True)
        ((_, got, hits, error, said),) = _as_users([uids[0]], gid, store, ram)
        assert error is None, error
        assert hits == 0 and "not in the shared group" in said and users[2] in said
        assert got == windows(zstore.WindowDataset(store, window_seconds=2.0, cache=False))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_shared_group_opt_in_rejects_a_world_writable_directory(small_store, tmp_path):
    ram = tmp_path / "ram"
    ram.mkdir()
    os.chown(ram, -1, os.getegid())
    ram.chmod(0o2777)
    cfg = zstore.CacheConfig(ram_dir=ram, ram_bytes="64MB", ssd_dir=None, shared_group=os.getegid())
    with pytest.warns(UserWarning, match="anyone"):
        ds = zstore.WindowDataset(small_store, window_seconds=2.0, cache=cfg)
        assert np.array_equal(
            ds[0]["wav"].numpy(),
            zstore.WindowDataset(small_store, window_seconds=2.0, cache=False)[0]["wav"].numpy(),
        )
    assert list(ram.iterdir()) == []
