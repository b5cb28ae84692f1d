"""The cache tiers: budget, integrity, concurrency and every failure degrading to the origin."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import warnings
from pathlib import Path

import pytest
import workers
from conftest import PYTHON, subprocess_env

import zstore
from zstore.cache import TieredCache, cache_stats, clear_cache
from zstore.cache._stats import Stats
from zstore.cache.tier import Tier
from zstore.cache.value import HEADER_SIZE
from zstore.testing import spawn_ranks


def values(n: int, size: int) -> dict[str, bytes]:
    return {f"k{i}": os.urandom(size) for i in range(n)}


def make_cache(tmp_path: Path, ram="4MB", ssd="8MB", **kw) -> TieredCache:
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes=ram, ssd_dir=tmp_path / "ssd", ssd_bytes=ssd, **kw
    )
    return TieredCache(cfg.resolved(), "store-1")


def test_get_put_and_miss(tmp_path):
    tier = Tier("ram", str(tmp_path / "t"), 2**24, Stats(None))
    assert tier.get("a") is None
    assert tier.put("a", b"hello")
    assert tier.get("a") == b"hello"


def test_put_many_stores_in_one_transaction_and_a_refusal_keeps_the_others(tmp_path, monkeypatch):
    from zstore.cache._space import Refused

    tier = Tier("ram", str(tmp_path / "t"), 2**24, Stats(None))
    first = values(3, 50_000)
    assert tier.put_many(list(first.items())) == 3
    assert all(tier.get(k) == v for k, v in first.items())

    # Admission refuses "b" part-way through a transaction: it rolls back, the files it
    # wrote are removed, and the others are stored one by one.
    real = tier.room.make

    def refuse_b(cache, sql, cleanup, need, key):
        if key == "b":
            raise Refused
        return real(cache, sql, cleanup, need, key)

    monkeypatch.setattr(tier.room, "make", refuse_b)
    more = {k: os.urandom(50_000) for k in "abc"}
    assert tier.put_many(list(more.items())) == 2
    assert tier.get("a") == more["a"] and tier.get("c") == more["c"]
    assert tier.get("b") is None
    files = list((tmp_path / "t").rglob("*.val"))
    assert len(files) == tier.usage()["entries"] == 5  # no file outlives its rollback


def test_bytes_on_disk_stay_within_budget(tmp_path):
    budget = 3 * 2**20
    tier = Tier("ram", str(tmp_path / "t"), budget, Stats(str(tmp_path / "stats")))
    for key, value in values(60, 150_000).items():
        assert tier.put(key, value)
        assert tier.usage()["bytes_on_disk"] <= budget
    usage = tier.usage()
    assert usage["entries"] >= 10  # the budget is used, not wasted
    counts = zstore.cache._stats.read_stats(str(tmp_path / "stats"))
    assert counts["ram_evictions"] == 60 - usage["entries"]


def test_evictions_are_logged_after_their_files_are_gone(tmp_path):
    # A reader whose SQLite snapshot predates an eviction can still open the evicted file
    # until it is unlinked; it unmaps it when it finds the inode in the eviction log, so
    # the log may only advance once the files are gone (else the map outlives the budget).
    directory = tmp_path / "t"
    tier = Tier("ram", str(directory), 3 * 2**20, Stats(str(tmp_path / "stats")))
    logged: list[int] = []
    record = tier.evictions.record

    def record_checked(inodes: list[int]) -> None:
        alive = {p.stat().st_ino for p in directory.rglob("*.val")}
        assert not alive & set(inodes), "eviction logged before its file was unlinked"
        logged.extend(inodes)
        record(inodes)

    tier.evictions.record = record_checked  # type: ignore[method-assign]
    for key, value in values(40, 150_000).items():
        assert tier.put(key, value)
    counts = zstore.cache._stats.read_stats(str(tmp_path / "stats"))
    assert counts["ram_evictions"] > 0 and len(logged) == counts["ram_evictions"]
    assert tier.evictions.since(0) == (len(logged), logged)


def test_value_larger_than_budget_bypasses(tmp_path):
    # A tier's index (SQLite db, -wal, -shm) needs ~0.1-0.4 MiB, so 1 MiB is about the
    # smallest useful budget; a value larger than the budget skips the tier entirely.
    cache = make_cache(tmp_path, ram="1MB", ssd="1MB")
    big = os.urandom(1_500_000)
    assert cache.get("big", lambda: big) == big
    assert cache.get("big", lambda: big) == big
    assert cache.ram.get(cache.key("big")) is None and cache.ssd.get(cache.key("big")) is None
    for tier in (cache.ram, cache.ssd):
        assert tier.usage()["bytes_on_disk"] <= 1_000_000
    counts = zstore.cache._stats.read_stats(str(tmp_path / "ram" / "stats"))
    assert counts["ram_bypassed"] == 2 and counts["ssd_bypassed"] == 2


def test_ssd_hit_is_promoted_to_ram(tmp_path):
    cache = make_cache(tmp_path)
    cache.fill("x", b"data", ram=False)
    assert cache.ram.get(cache.key("x")) is None
    assert cache.lookup("x") == b"data"
    assert cache.ram.get(cache.key("x")) == b"data"


def test_values_read_into_given_memory_are_views_of_it_and_still_checked(tmp_path):
    """``get_many(into=...)`` reads each value into the view ``into`` gives (a reader's
    reused slabs): the payload is a view of that memory, a value too large for it is
    read into memory of its own, and a corrupt value is refused as before."""
    from zstore.buffers import Slabs

    tier = Tier("ssd", str(tmp_path / "t"), 2**24, Stats(None))
    data = values(4, 50_000)
    data["big"] = os.urandom(300_000)  # larger than a slab
    for k, v in data.items():
        assert tier.put(k, v)
    slabs = Slabs(slab_bytes=200_000, keep_bytes=400_000)
    got = tier.get_many(list(data), into=slabs.take)
    assert [bytes(g) for g in got] == list(data.values())  # type: ignore[arg-type]
    assert slabs.in_use() == 2  # the four small values, two to a slab
    victim = next(f for f in (tmp_path / "t").rglob("*.val") if f.stat().st_size < 100_000)
    raw = bytearray(victim.read_bytes())
    raw[HEADER_SIZE + 10] ^= 0x55
    victim.write_bytes(bytes(raw))
    del got
    again = tier.get_many(list(data), into=slabs.take)
    assert sum(g is None for g in again) == 1
    assert all(bytes(g) == data[k] for k, g in zip(data, again) if g is not None)


def test_get_many_without_waiting_fetches_keys_whose_lock_is_held_and_keeps_the_rest(tmp_path):
    """``wait=False``: a key whose node lock another holder has (another process's
    fill, or its held work) is fetched at once and not kept; the others are locked,
    fetched and kept as with ``wait=True``; nothing waits."""
    from zstore.cache._locks import StripedLocks

    cache = make_cache(tmp_path)
    locks = cache.fill_locks
    other = StripedLocks(locks.directory, locks.kind, locks.stripes)  # descriptors of its own
    keys = [f"k{i}" for i in range(6)]
    busy_key = keys[0]
    held = other.acquire([busy_key], wait=False)
    assert held is not None
    free = [
        k for k in keys if locks._stripes([cache.key(k)]) != locks._stripes([cache.key(busy_key)])
    ]
    assert free
    fetched: list[list[str]] = []
    got = cache.get_many(
        keys, lambda miss: fetched.append(miss) or [k.encode() for k in miss], wait=False
    )
    assert got == [k.encode() for k in keys] and fetched == [keys]  # one call, no wait
    assert cache.lookup(busy_key) is None  # fetched, not kept
    assert all(cache.lookup(k) == k.encode() for k in free)
    other.release(held)


def test_namespaces_never_mix(tmp_path):
    a, b = make_cache(tmp_path), make_cache(tmp_path)
    b.namespace = "store-2"
    a.fill("k", b"from store 1")
    assert b.lookup("k") is None


def test_corrupted_values_are_dropped_and_fetched_again(tmp_path):
    cache = make_cache(tmp_path)
    data = values(5, 50_000)
    for k, v in data.items():
        cache.get(k, lambda v=v: v)
    for root in (tmp_path / "ram", tmp_path / "ssd"):
        for f in root.rglob("*.val"):
            raw = bytearray(f.read_bytes())
            raw[HEADER_SIZE + 10] ^= 0x55
            f.write_bytes(bytes(raw))
    fetched = []
    for k, v in data.items():
        assert cache.get(k, lambda k=k, v=v: fetched.append(k) or v) == v
    assert sorted(fetched) == sorted(data)  # every corrupt value went back to the origin
    counts = zstore.cache._stats.read_stats(str(tmp_path / "ram" / "stats"))
    assert counts["ram_corrupt"] == 5 and counts["ssd_corrupt"] == 5
    for k, v in data.items():
        assert cache.get(k, lambda: b"wrong") == v  # refilled with good values


def test_truncated_value_file_is_a_miss(tmp_path):
    tier = Tier("ssd", str(tmp_path / "t"), 2**24, Stats(None))
    tier.put("k", b"x" * 10_000)
    f = next((tmp_path / "t").rglob("*.val"))
    f.write_bytes(f.read_bytes()[:5000])
    assert tier.get("k") is None and tier.get("k") is None


def test_killed_writer_leaves_nothing_visible(tmp_path):
    tier_dir, ready = tmp_path / "t", tmp_path / "ready"
    proc = subprocess.Popen(
        [
            PYTHON,
            "-c",
            f"import sys, workers; workers.write_then_hang({str(tier_dir)!r}, {str(ready)!r})",
        ],
        env={
            **subprocess_env(),
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).parent.parent), subprocess_env()["PYTHONPATH"]]
            ),
        },
    )
    try:
        while not ready.exists() or not ready.read_text():
            try:
                proc.wait(timeout=0.02)
                pytest.fail(f"writer exited early with {proc.returncode}")
            except subprocess.TimeoutExpired:
                pass
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    partial = Path(ready.read_text())
    assert partial.exists()  # the half-written file is there ...
    tier = Tier("ram", str(tier_dir), 64 * 2**20, Stats(None))
    assert tier.get("victim") is None  # ... but never visible as a value
    assert tier.put("after", b"ok") and tier.get("after") == b"ok"  # no lock left behind
    # a sweep as a tier object's first call (``zstore cache clear``'s): it opened
    # nothing and found no index, and removed nothing
    fresh = Tier("ram", str(tier_dir), 64 * 2**20, Stats(None))
    assert fresh.sweep(min_age=0) == 1 and not partial.exists()


def test_processes_filling_one_key_never_tear_it(tmp_path):
    bad = spawn_ranks(
        workers.fill_same_key,
        4,
        lambda rank, barrier, queue: (str(tmp_path / "t"), 2**20, barrier, 40, queue),
    )
    assert bad == [0, 0, 0, 0]
    assert Tier("ram", str(tmp_path / "t"), 2**20, Stats(None)).usage()["bytes_on_disk"] <= 2**20


def test_deleted_cache_directory_while_reading(tmp_path):
    cache = make_cache(tmp_path)
    data = values(8, 40_000)
    for k, v in data.items():
        assert cache.get(k, lambda v=v: v) == v
    shutil.rmtree(tmp_path / "ram")
    shutil.rmtree(tmp_path / "ssd")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            for k, v in data.items():
                assert cache.get(k, lambda v=v: v) == v


def test_network_file_system_disables_the_tier(tmp_path, monkeypatch):
    monkeypatch.setattr("zstore.urls.filesystem_type", lambda path: "nfs4")
    cache = make_cache(tmp_path)
    with pytest.warns(UserWarning, match="network file system"):
        assert cache.get("k", lambda: b"v") == b"v"
    assert cache.get("k", lambda: b"v2") == b"v2"  # nothing cached, origin read again


def _mount_tmpfs(path: Path, size: str, ro: bool = False) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size},mode=0700" + (",ro" if ro else "")  # a tmpfs is 1777 by default
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs (mount needs root, which CI has); else a size-limited file via rlimit."""
    path = tmp_path / "tiny"
    mounted = os.geteuid() == 0 and _mount_tmpfs(path, "1m")
    yield path, mounted
    if mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_full_tmpfs_degrades_to_the_origin(tiny_tmpfs, tmp_path):
    path, mounted = tiny_tmpfs
    if not mounted:  # without root: the same failure through RLIMIT_FSIZE in a child
        code = (
            "import resource, signal, os; signal.signal(signal.SIGXFSZ, signal.SIG_IGN);"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000));"
            "from zstore.cache import TieredCache; import zstore, warnings;"
            f"c = TieredCache(zstore.CacheConfig(ram_dir={str(path)!r}, ram_bytes='64MB',"
            "ssd_dir=None).resolved(), 'n');"
            "vals = [os.urandom(300_000) for _ in range(5)];"
            "assert all(c.get(f'k{i}', lambda v=v: v) == v for i, v in enumerate(vals))"
        )
        subprocess.run([PYTHON, "-c", code], env=subprocess_env(), check=True, timeout=300)
        return
    (path / "other").write_bytes(b"\0" * 700_000)  # another user of the tmpfs filled it
    cfg = zstore.CacheConfig(ram_dir=path / "tier", ram_bytes="64MB", ssd_dir=None)
    with pytest.warns(UserWarning, match="keeps to"):  # 90% of the tmpfs: not free enough
        cache = TieredCache(cfg.resolved(), "n")
    data = values(8, 300_000)
    with pytest.warns(UserWarning, match="write failed"):
        for k, v in data.items():
            assert cache.get(k, lambda v=v: v) == v
    for k, v in data.items():
        assert cache.get(k, lambda v=v: v) == v


def test_a_budget_larger_than_its_tmpfs_keeps_the_tier_working(tmp_path):
    """A budget above the tmpfs keeps to 90% of it: the tier evicts as for any budget,
    where it used to fill the tmpfs, fail its own index ("database or disk is full")
    and be read past by every process."""
    import warnings

    path = tmp_path / "small"
    if not (os.geteuid() == 0 and _mount_tmpfs(path, "8m")):
        pytest.skip("needs a tmpfs of its own (root)")
    try:
        cfg = zstore.CacheConfig(ram_dir=path / "tier", ram_bytes="64MB", ssd_dir=None)
        with pytest.warns(UserWarning, match=r"larger than the file system .*keeps to"):
            cache = TieredCache(cfg.resolved(), "n")
        data = values(16, 1_000_000)  # twice the tmpfs
        fetched: list[str] = []

        def origin(k: str, v: bytes) -> bytes:
            fetched.append(k)
            return v

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no write fails, the index always opens
            for _ in range(3):
                for k, v in data.items():
                    assert cache.get(k, lambda k=k, v=v: origin(k, v)) == v
        assert len(fetched) < 3 * len(data)  # the tier served some of them
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_read_only_cache_directory(tmp_path):
    ro = tmp_path / "ro"
    if os.geteuid() == 0 and _mount_tmpfs(ro, "1m", ro=True):
        try:
            cache = TieredCache(
                zstore.CacheConfig(ram_dir=ro, ram_bytes="1MB", ssd_dir=None).resolved(), "n"
            )
            with pytest.warns(UserWarning, match="cannot be opened"):
                assert cache.get("k", lambda: b"v") == b"v"
        finally:
            subprocess.run(["umount", "-l", str(ro)], check=False)
    else:
        ro.mkdir()
        ro.chmod(0o500)
        cache = TieredCache(
            zstore.CacheConfig(ram_dir=ro, ram_bytes="1MB", ssd_dir=None).resolved(), "n"
        )
        with pytest.warns(UserWarning, match="cannot be opened"):
            assert cache.get("k", lambda: b"v") == b"v"


def test_stats_aggregate_over_processes_and_clear(tmp_path):
    cfg = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="4MB", ssd_dir=None)
    code = (
        "import zstore; from zstore.cache import TieredCache;"
        f"c = TieredCache(zstore.CacheConfig(ram_dir={str(tmp_path / 'ram')!r},"
        "ram_bytes='4MB', ssd_dir=None).resolved(), 'n');"
        "[c.get(f'k{i}', lambda: b'x' * 1000) for i in range(3)]"
    )
    for _ in range(2):
        subprocess.run([PYTHON, "-c", code], env=subprocess_env(), check=True, timeout=300)
    stats = cache_stats(cfg)
    assert stats["ram"]["misses"] == 3 and stats["ram"]["hits"] == 3
    assert stats["ram"]["fills"] == 3 and stats["ram"]["entries"] == 3
    assert stats["ram"]["hit_rate"] == 0.5
    clear_cache(cfg)
    stats = cache_stats(cfg)
    assert stats["ram"]["entries"] == 0 and stats["ram"]["hits"] == 0


def _spy_on_stores(monkeypatch, tier: Tier) -> tuple[list[tuple[str, bool]], threading.Event]:
    """(type of value, whether inside the index's transaction) of each file write, and
    an event set after the first."""
    from zstore.cache._tier_files import TierDisk

    seen: list[tuple[str, bool]] = []
    stored = threading.Event()
    real = TierDisk.store

    def store(self, value, read, key=None):
        seen.append((type(value).__name__, tier._cache._txn_id is not None))
        try:
            return real(self, value, read, key=key)
        finally:
            stored.set()

    monkeypatch.setattr(TierDisk, "store", store)
    return seen, stored


def test_a_value_file_is_written_before_the_index_is_locked(tmp_path, monkeypatch):
    """With room in the tier, a value's file is written first and the index's write
    lock is held only for its rows: written inside the transaction, the node's writers
    took the lock in turn for a whole 7 MB file each, and one rank's SSD writes waited
    behind the others' for epochs."""
    import sqlite3

    tier = Tier("ssd", str(tmp_path / "t"), 2**26, Stats(None), admission=True)
    assert tier.put("first", b"opens the index")
    seen, stored = _spy_on_stores(monkeypatch, tier)
    value = os.urandom(2**20)
    other = sqlite3.connect(tmp_path / "t" / "cache.db", timeout=60, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process's write transaction
    done: list[bool] = []
    writer = threading.Thread(target=lambda: done.append(tier.put("k", value)))
    try:
        writer.start()
        assert stored.wait(60)  # the file is written while the index stays locked
        assert seen[0] == ("Parts", False)
    finally:
        other.execute("COMMIT")
        other.close()
    writer.join(120)
    assert done == [True] and tier.get("k") == value
    assert [inside for _, inside in seen[1:]] == [True]  # then recorded, not written again


def test_near_its_budget_a_tier_writes_after_making_room(tmp_path, monkeypatch):
    """Near the budget the file is written inside the transaction, after the evictions
    that make room for it: writers that each found room before writing could together
    put the tier over its budget."""
    budget = 3 * 2**20
    tier = Tier("ram", str(tmp_path / "t"), budget, Stats(None))
    for key, value in values(12, 200_000).items():
        assert tier.put(key, value)
    seen, _ = _spy_on_stores(monkeypatch, tier)
    assert tier.put("late", os.urandom(200_000))
    assert seen == [("Parts", True)]
    assert tier.usage()["bytes_on_disk"] <= budget


def test_a_value_file_swept_before_its_row_is_written_again(tmp_path, monkeypatch):
    """A file written before its index transaction has no row until the commit; a sweep
    that took it for a killed writer's (it waited over a minute for the index) must not
    leave a row without a file: the insert writes it again."""
    from zstore.cache._tier_files import TierDisk, Written

    tier = Tier("ssd", str(tmp_path / "t"), 2**26, Stats(None), admission=True)
    real = TierDisk.store

    def store_then_sweep(self, value, read, key=None):
        out = real(self, value, read, key=key)
        if tier._cache._txn_id is None and not isinstance(value, Written):
            os.unlink(self.last_path)  # written early, then swept before its transaction
        return out

    monkeypatch.setattr(TierDisk, "store", store_then_sweep)
    value = os.urandom(100_000)
    assert tier.put("k", value)
    monkeypatch.undo()
    assert tier.get("k") == value


def test_each_thread_sees_the_value_file_it_wrote(tmp_path):
    """A process's reads, RAM fills and SSD writes write value files at once, outside
    the index's lock; the path a put cleans up after a refusal is its own thread's (one
    shared attribute gave a fill another thread's path, or None)."""
    tier = Tier("ssd", str(tmp_path / "t"), 2**26, Stats(None), admission=True)
    assert tier.put("first", b"opens the index")
    disk = tier._cache.disk
    made, other_done = threading.Event(), threading.Event()
    seen: list[str | None] = []

    def first() -> None:
        _, mine = disk.filename()
        made.set()
        assert other_done.wait(60)
        seen.append(disk.last_path == mine and mine)

    thread = threading.Thread(target=first)
    thread.start()
    assert made.wait(60)
    _, theirs = disk.filename()  # another thread writes a file meanwhile
    other_done.set()
    thread.join(60)
    assert seen and seen[0] and seen[0] != theirs
    assert disk.last_path == theirs


def resident_pages(path) -> int:
    """Pages of the file at ``path`` in the page cache now (``mincore``)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = -(-size // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        anchor = ctypes.c_char.from_buffer(mm)
        try:
            assert libc.mincore(ctypes.addressof(anchor), size, vec) == 0, ctypes.get_errno()
        finally:
            del anchor
    finally:
        mm.close()
    return sum(b & 1 for b in vec.raw)


def value_files(directory) -> list[tuple[int, str]]:
    """(size, path) of the tier's value files."""
    return [
        (os.path.getsize(os.path.join(d, f)), os.path.join(d, f))
        for d, _, files in os.walk(directory)
        for f in files
        if f.endswith(".val")
    ]


def test_large_ssd_values_are_written_around_the_page_cache(tmp_path):
    """The SSD tier writes values of DIRECT_MIN bytes and more with O_DIRECT: nothing of
    them is in the page cache until they are read (a buffered write put every page
    there, fresh memory the first epoch paid for), and they read back whole, whatever
    their length's alignment; small values are written the buffered way."""
    from zstore.cache._direct import DIRECT_MIN

    tier = Tier("ssd", str(tmp_path / "ssd"), 2**26, Stats(None))
    sizes = [DIRECT_MIN, DIRECT_MIN + 1, 3 * DIRECT_MIN + 4095, 5000]
    data = {f"v{n}": os.urandom(n) for n in sizes}
    assert tier.put_many(list(data.items())) == len(data)
    assert tier.put("blocked", data[f"v{3 * DIRECT_MIN + 4095}"], blocked=True)
    files = value_files(tmp_path / "ssd")
    assert len(files) == len(data) + 1
    small = [path for size, path in files if size < DIRECT_MIN]
    large = [path for size, path in files if size >= DIRECT_MIN]
    assert len(small) == 1 and len(large) == 4
    assert resident_pages(small[0]) == 2  # the helper sees a buffered write's pages
    assert [resident_pages(path) for path in large] == [0] * 4
    for key, payload in data.items():
        assert tier.get(key) == payload
    checked, _, _ = tier.get_mapped("blocked")
    assert checked.verify(0, len(checked.payload))
    assert bytes(checked.payload) == data[f"v{3 * DIRECT_MIN + 4095}"]


def test_a_file_system_that_refuses_direct_writes_gets_buffered_ones(tmp_path, monkeypatch):
    import errno

    import zstore.cache._direct as direct

    real = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real(path, flags, *args)

    monkeypatch.setattr(direct.os, "open", no_direct)
    tier = Tier("ssd", str(tmp_path / "ssd"), 2**26, Stats(None))
    payload = os.urandom(2 * direct.DIRECT_MIN + 7)
    assert tier.put("a", payload)
    assert tier.put("b", payload[::-1])
    assert tier.get("a") == payload and tier.get("b") == payload[::-1]
    assert [resident_pages(path) > 0 for _, path in value_files(tmp_path / "ssd")] == [True] * 2


def test_ram_values_written_through_a_tier_object_are_mapped_without_block_checks(tmp_path):
    """The RAM tier object that wrote a value maps it with its blocks taken as checked
    (it computed their checksums from the bytes it wrote, into memory); another tier
    object on the same directory (another reader, another process) checks them, and so
    does the writer once another writer replaced the value.  The SSD tier's values,
    on a device, are always checked."""
    payload, other_payload = os.urandom(600_000), os.urandom(600_000)
    writer = Tier("ram", str(tmp_path / "ram"), 2**26, Stats(None))
    assert writer.put("v", payload, blocked=True)
    checked, _, _ = writer.get_mapped("v")
    assert checked.complete and bytes(checked.payload) == payload

    reader = Tier("ram", str(tmp_path / "ram"), 2**26, Stats(None))
    checked, _, _ = reader.get_mapped("v")
    assert not checked.complete
    assert checked.verify(0, len(checked.payload)) and checked.complete

    assert reader.put("v", other_payload, blocked=True)  # a new file under the same key
    checked, _, _ = writer.get_mapped("v")
    assert not checked.complete
    assert checked.verify(0, len(checked.payload)) and bytes(checked.payload) == other_payload

    ssd = Tier("ssd", str(tmp_path / "ssd"), 2**26, Stats(None))
    assert ssd.put("v", payload, blocked=True)
    checked, _, _ = ssd.get_mapped("v")
    assert not checked.complete


def test_a_value_changed_in_place_after_its_write_is_checked_by_its_writer_too(tmp_path):
    """A write into the value's file after the tier object wrote it moves the file's
    change time: the writer no longer takes it for its own, checks its blocks and finds
    the damage, as any other reader does."""
    payload = os.urandom(600_000)
    writer = Tier("ram", str(tmp_path / "ram"), 2**26, Stats(None))
    assert writer.put("v", payload, blocked=True)
    ((_, path),) = value_files(tmp_path / "ram")
    with open(path, "r+b") as f:  # one byte flipped in place: the same inode
        f.seek(-1000, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1000, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    for tier in (writer, Tier("ram", str(tmp_path / "ram"), 2**26, Stats(None))):
        checked, _, _ = tier.get_mapped("v")
        assert not checked.complete
        assert not checked.verify(0, len(checked.payload))


class _Advised:
    """Stands in for a value's map: records the ``madvise`` calls made on it."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def madvise(self, advice: int, start: int, length: int) -> None:
        self.calls.append((advice, start, length))


def test_prefetch_asks_for_the_pages_of_unchecked_blocks_once():
    """``Checked.prefetch`` asks the kernel to read a mapped value's byte range in, page
    aligned from where the payload starts in the map, and only while some of its
    blocks are unchecked (read for the first time in this process)."""
    import mmap

    import numpy as np
    from crc32c import crc32c

    from zstore.cache.value import BLOCK, Checked

    payload = os.urandom(4 * BLOCK)
    table = np.array(
        [crc32c(payload[i : i + BLOCK]) for i in range(0, len(payload), BLOCK)], dtype="<u4"
    )
    advised = _Advised()
    offset = 3 * 64  # where the payload starts in the map (after header and table)
    checked = Checked(memoryview(payload), table, advised, offset)  # type: ignore[arg-type]
    checked.prefetch(BLOCK + 10, 2 * BLOCK + 5)
    page = mmap.PAGESIZE
    start = (offset + BLOCK + 10) // page * page
    assert advised.calls == [(mmap.MADV_WILLNEED, start, offset + 2 * BLOCK + 5 - start)]
    assert checked.verify(BLOCK + 10, 2 * BLOCK + 5)
    checked.prefetch(BLOCK, 3 * BLOCK)  # these blocks are checked: in memory already
    assert len(advised.calls) == 1
    checked.prefetch(0, 10)  # the first block is not
    assert len(advised.calls) == 2
    plain = Checked(memoryview(payload), table)  # read, not mapped: nothing to ask
    plain.prefetch(0, len(payload))


def test_a_mapped_ssd_value_reads_right_after_a_prefetch(tmp_path):
    """A prefetch of part of a large SSD value written around the page cache is advice
    only: the value maps, checks and reads whole after it, plain or at odd offsets."""
    from zstore.cache._direct import DIRECT_MIN

    tier = Tier("ssd", str(tmp_path / "ssd"), 2**26, Stats(None))
    payload = os.urandom(3 * DIRECT_MIN + 4095)
    assert tier.put("v", payload, blocked=True)
    checked, _, _ = tier.get_mapped("v")
    checked.prefetch(DIRECT_MIN + 7, 2 * DIRECT_MIN + 3)
    checked.prefetch(len(payload) - 10, len(payload))
    assert checked.verify(0, len(payload))
    assert bytes(checked.payload) == payload


def test_counts_from_threads_that_count_first_at_once_are_all_kept(tmp_path, monkeypatch):
    """A process's first counts, from two threads at once (a read and the thread behind
    it): both land in the process's counter file (one went to a throwaway array)."""
    import threading

    from zstore.cache._stats import _INDEX, Stats

    stats = Stats(str(tmp_path / "stats"))
    real = Stats._made
    entered, go = threading.Event(), threading.Event()

    def slow(self, pid):
        entered.set()
        assert go.wait(60)
        return real(self, pid)

    monkeypatch.setattr(Stats, "_made", slow)
    first = threading.Thread(target=stats.add, args=("ram_hits", 5))
    first.start()
    assert entered.wait(60)
    second = threading.Thread(target=stats.add, args=("ram_fills", 3))
    second.start()
    go.set()
    first.join(60)
    second.join(60)
    counts = stats._counts
    assert counts[_INDEX["ram_hits"]] == 5 and counts[_INDEX["ram_fills"]] == 3
    assert type(counts).__name__ == "memmap"  # the file every process's stats read


def test_a_thread_never_sees_a_tier_half_opened(tmp_path, monkeypatch):
    """A process's first use of a tier from two threads at once: the second one, arriving
    while the first is still opening the tier's index, gets the tier (it got None, as
    for a tier refused, and its read went past the tier and wrote nothing).  The second
    thread runs inside the first one's open, so the order is fixed."""
    import zstore.cache.tier as tier_module

    real = tier_module.network_fs_type
    tier = Tier("ram", str(tmp_path / "t"), 2**24, Stats(None))
    started: list[threading.Thread] = []
    seen: list[object] = []

    def other_thread() -> None:
        seen.append(tier.put("b", b"from the other thread"))

    def opening(path: str) -> str | None:
        if not started:  # the first thread, halfway through its open
            started.append(threading.Thread(target=other_thread))
            started[0].start()
            started[0].join(timeout=120)
        return real(path)

    monkeypatch.setattr(tier_module, "network_fs_type", opening)
    assert tier.put("a", b"hello")
    assert seen == [True]
    assert tier.get("a") == b"hello" and tier.get("b") == b"from the other thread"


def test_the_keys_a_tier_lacks_are_found_in_one_query_and_counted_as_misses(tmp_path, monkeypatch):
    """``Tier.lacks`` answers for many keys at once (past SQLite's 500 parameters) and
    counts nothing; ``MappedValues.absent`` leaves out what the process has mapped and
    counts each key it returns as ``get`` counts a miss.  A batch's first touches of
    ~60 shards were ~60 lookups, each its own SQLite round."""
    from zstore.read._maps import MappedValues

    cfg = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="4MB", ssd_dir=None)
    cache = TieredCache(cfg.resolved(), "n")
    tier = cache.ram
    assert tier is not None
    for key in ("a", "b"):
        assert tier.put(key, key.encode() * 100)
    keys = ["a", "b", "c", *(f"m{i}" for i in range(700))]
    assert tier.lacks(keys) == set(keys) - {"a", "b"}
    assert cache_stats(cfg)["ram"]["misses"] == 0

    values = MappedValues(tier)
    assert values.get("a", lambda checked: bytes(checked.payload)) is not None  # mapped
    misses = cache_stats(cfg)["ram"]["misses"]
    assert values.absent(keys) == set(keys) - {"a", "b"}
    assert cache_stats(cfg)["ram"]["misses"] == misses + len(keys) - 2
    assert values.absent(["a"]) == set()  # mapped: not asked of the tier at all

    def opened() -> None:
        raise AssertionError("the tier was opened for no keys")

    monkeypatch.setattr(tier, "_open", opened)  # a warm batch asks the tier nothing
    assert tier.lacks([]) == set() and values.absent(["a"]) == set()
