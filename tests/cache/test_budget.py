"""Data larger than the RAM budget: what ram_format="auto" picks, admission keeps a
stable resident set under random access yet adapts to a new pattern, and windows read
partly from resident decoded shards and partly from chunks are bit-identical."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import zarr
from conftest import zstore_cli

import zstore
from zstore.cache._admission import FrequencySketch, admit, sketch_width
from zstore.cache._stats import Stats
from zstore.cache.ram_format import choose, record
from zstore.cache.tier import Tier
from zstore.cache.tiered import node_dir
from zstore.format.layout import Span
from zstore.read.reader import WindowReader

GB = 10**9


def resolved(tmp_path, ram_bytes, ssd_bytes, ram_format="auto"):
    """A node's resolved cache with these budgets, whatever this machine's file systems
    hold (resolving keeps a budget to 90% of its file system: a node of more memory and
    disk than this one is modelled here)."""
    import dataclasses

    config = zstore.CacheConfig(
        ram_dir=tmp_path / "ram",
        ram_bytes="1MB",
        ssd_dir=tmp_path / "ssd" if ssd_bytes else None,
        ssd_bytes="1MB" if ssd_bytes else 0,
        ram_format=ram_format,
    ).resolved()
    return dataclasses.replace(config, ram_bytes=ram_bytes, ssd_bytes=ssd_bytes)


@pytest.mark.parametrize(
    "ram,ssd,expected",
    [
        (400 * GB, 200 * GB, "decoded"),  # the decoded data fits
        (100 * GB, 200 * GB, "decoded"),  # a third fits decoded; the SSD tier has the store
        (10 * GB, 200 * GB, "decoded"),
        (200 * GB, 0, "encoded"),  # no SSD tier: the compressed store fits RAM
        (200 * GB, 50 * GB, "encoded"),  # an SSD tier too small for the store
        (100 * GB, 0, "decoded"),  # not even the compressed store fits: decoded share
    ],
)
def test_auto_format_choice(tmp_path, ram, ssd, expected):
    choice = choose(resolved(tmp_path, ram, ssd), decoded_bytes=300 * GB, stored_bytes=155 * GB)
    assert choice.format == expected
    assert "RAM budget" in choice.reason and choice.budget == ram


def test_the_reason_says_the_share_rounded_down(tmp_path):
    """A budget just short of the data is not said to hold 100% of it."""
    short = choose(resolved(tmp_path, 299 * GB, 200 * GB), 300 * GB, 155 * GB)
    assert short.reason.startswith("99% of the decoded data fits"), short.reason
    assert "the SSD tier serves the rest" in short.reason
    without = choose(resolved(tmp_path, 100 * GB, 50 * GB), 300 * GB, 155 * GB)
    assert "33% of" in without.reason and "the SSD tier and the origin serve" in without.reason


def test_explicit_formats_are_kept(tmp_path):
    for fmt in ("decoded", "encoded"):
        choice = choose(resolved(tmp_path, 1 * GB, 0, fmt), 300 * GB, 155 * GB)
        assert choice.format == fmt and "explicitly" in choice.reason


def test_the_choice_is_recorded_for_cache_stats(small_store, tmp_path):
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="1MB", ssd_dir=tmp_path / "ssd", ssd_bytes="64MB"
    )
    reader = WindowReader(small_store, cache=cfg).open()
    assert reader.format_choice.format == "chunks"  # a local store: read by ranges
    formats = zstore.cache_stats(cfg)["formats"]
    assert formats[reader.manifest.store_id]["format"] == "chunks"
    text = zstore_cli(
        "cache",
        "stats",
        "--ram-dir",
        str(tmp_path / "ram"),
        "--ram-bytes",
        "1MB",
        "--ssd-dir",
        str(tmp_path / "ssd"),
    )
    assert "RAM tier holds decoded data, filled by the reads" in text.stdout
    assert "fits" in text.stdout


def test_cache_stats_lists_the_latest_formats_and_clear_forgets_them(small_store, tmp_path):
    dirs = ["--ram-dir", str(tmp_path / "ram"), "--ssd-dir", ""]
    cfg = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="1MB", ssd_dir=None)
    formats_dir = node_dir(cfg.resolved(), "formats")
    older = choose(cfg.resolved(), decoded_bytes=300 * GB, stored_bytes=155 * GB)
    for i in range(12):  # stores opened on this node before (their records)
        record(formats_dir, f"old{i:02d}", older)
        os.utime(os.path.join(formats_dir, f"old{i:02d}.json"), (1000 + i, 1000 + i))
    reader = WindowReader(small_store, cache=cfg).open()  # records its store's format now
    formats = list(zstore.cache_stats(cfg)["formats"])
    assert formats[0] == reader.manifest.store_id and formats[1:3] == ["old11", "old10"]
    assert len(formats) == 13
    text = zstore_cli("cache", "stats", *dirs, "--ram-bytes", "1MB").stdout
    shown = [line.split()[1].rstrip(":") for line in text.splitlines() if line.startswith("store ")]
    assert shown == formats[:10]
    assert "... and 3 stores opened earlier" in text
    assert zstore_cli("cache", "clear", *dirs).returncode == 0
    assert zstore.cache_stats(cfg)["formats"] == {}
    assert "store " not in zstore_cli("cache", "stats", *dirs).stdout
    assert (
        WindowReader(small_store, cache=cfg).open().manifest.store_id
        in zstore.cache_stats(cfg)["formats"]
    )


def test_admission_rule():
    assert admit(1, [])  # nothing to displace
    assert not admit(3, [1])  # about as popular: keep the resident value
    assert admit(4, [1]) and admit(10, [4, 0]) and not admit(9, [4, 0])


def test_sketch_is_shared_and_ages(tmp_path):
    a = FrequencySketch(str(tmp_path), sketch_width(1 << 20))
    b = FrequencySketch(str(tmp_path), sketch_width(1 << 20))  # as another process
    for _ in range(5):
        a.touch("k")
    assert b.estimate("k") >= 5 and b.estimate("other") <= 1
    b.set_period(4096)
    for i in range(4096):
        b.touch(f"noise{i}")
    assert a.estimate("k") <= 3  # halved once the period was reached


def _tier(tmp_path, budget):
    return Tier("ram", str(tmp_path / "t"), budget, Stats(None), admission=True)


def test_a_full_tier_keeps_its_resident_set_under_random_access(tmp_path):
    tier = _tier(tmp_path, 4 * 2**20)
    value = os.urandom(200_000)
    keys = [f"k{i}" for i in range(60)]  # ~12 MB of values for a 4 MB tier
    rng = np.random.default_rng(0)
    for key in keys:  # the first pass fills the tier
        if tier.get(key) is None:
            tier.put(key, value)
    resident = {k for k in keys if tier.get(k, count_miss=False) is not None}
    assert 8 <= len(resident) < 20
    evictions = 0
    for key in map(str, rng.choice(keys, 600)):  # uniform random access, like random windows
        if tier.get(key) is None:
            before = len(tier._open())
            tier.put(key, value)
            evictions += before >= len(tier._open())
    now = {k for k in keys if tier.get(k, count_miss=False) is not None}
    assert len(now & resident) >= 0.8 * len(resident)  # stable, not churned
    assert tier.usage()["bytes_on_disk"] <= 4 * 2**20


def test_a_changed_pattern_wins_its_place(tmp_path):
    tier = _tier(tmp_path, 4 * 2**20)
    value = os.urandom(200_000)
    old = [f"old{i}" for i in range(40)]
    for key in old:
        if tier.get(key) is None:
            tier.put(key, value)
    new = [f"new{i}" for i in range(8)]  # a new subset, read again and again
    for _ in range(12):
        for key in new:
            if tier.get(key) is None:
                tier.put(key, value)
    assert sum(tier.get(k, count_miss=False) is not None for k in new) == len(new)


@pytest.mark.parametrize("ram_format", ["auto", "encoded"])
def test_windows_beyond_the_budget_are_bit_identical(small_store, tmp_path, ram_format):
    """A RAM tier of a fraction of the decoded data: some windows come from resident
    decoded shards, some from chunks (SSD tier), some span both; all equal the origin."""
    root = zarr.open_group(small_store, mode="r")
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram",
        ram_bytes="3MB",
        ram_format=ram_format,
        ssd_dir=tmp_path / "ssd",
        ssd_bytes="64MB",
    )
    reader = WindowReader(small_store, cache=cfg)
    items = sorted(root.group_keys())
    rng = np.random.default_rng(1)
    for _ in range(4):  # epochs
        for item in rng.permutation(items):
            n = root[f"{item}/act"].shape[-1]
            a = int(rng.integers(0, max(1, n - 150)))
            b = min(n, a + 150)
            got = reader.read(item, {"wav": Span(a * 160, b * 160), "act": Span(a, b)})
            np.testing.assert_array_equal(got["wav"], root[f"{item}/wav"][:, a * 160 : b * 160])
            np.testing.assert_array_equal(got["act"], root[f"{item}/act"][:, a:b])
    stats = zstore.cache_stats(cfg)
    assert stats["ram"]["bytes_on_disk"] <= 3_000_000
    assert stats["ram"]["rejected"] + stats["ram"]["evictions"] > 0  # it really was full
    assert stats["ram"]["hits"] > 0 and stats["ssd"]["hits"] > 0


def test_corrupt_chunks_behind_a_full_ram_tier_are_refetched(small_store, tmp_path):
    root = zarr.open_group(small_store, mode="r")
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="256KB", ssd_dir=tmp_path / "ssd", ssd_bytes="64MB"
    )
    reader = WindowReader(small_store, cache=cfg)
    item = sorted(root.group_keys())[3]
    span = {"wav": Span(16000, 48000)}
    reader.read(item, span)
    for dirpath, _, files in os.walk(tmp_path / "ssd"):  # flip a byte in every value
        for name in files:
            if name.endswith(".val"):
                path = os.path.join(dirpath, name)
                data = bytearray(open(path, "rb").read())
                data[-1] ^= 0xFF
                open(path, "wb").write(bytes(data))
    again = WindowReader(small_store, cache=cfg).read(item, span)["wav"]
    np.testing.assert_array_equal(again, root[f"{item}/wav"][:, 16000:48000])
    assert zstore.cache_stats(cfg)["ssd"]["corrupt"] > 0


@pytest.mark.parametrize("ram_format", ["decoded", "encoded"])
def test_corrupt_shards_in_ram_are_dropped_and_rebuilt(small_store, tmp_path, ram_format):
    root = zarr.open_group(small_store, mode="r")
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram",
        ram_bytes="64MB",
        ram_format=ram_format,
        ssd_dir=tmp_path / "ssd",
        ssd_bytes="64MB",
    )
    item = sorted(root.group_keys())[2]
    spans = {"wav": Span(8000, 40000), "act": Span(50, 250)}
    first = WindowReader(small_store, cache=cfg).open()
    first.start_builds()  # past its first read, which asks for no build
    first.read(item, spans)
    assert first.settle(timeout=120)  # its shards, filled behind the read, are in
    flipped = 0
    for dirpath, _, files in os.walk(tmp_path / "ram"):
        for name in files:
            path = os.path.join(dirpath, name)
            if name.endswith(".val") and os.path.getsize(path) > 8192:
                data = bytearray(open(path, "rb").read())
                for i in range(4096, len(data), 4096):  # every block of the payload
                    data[i] ^= 0xFF
                open(path, "wb").write(bytes(data))
                flipped += 1
    assert flipped
    got = WindowReader(small_store, cache=cfg).read(item, spans)  # a fresh process's maps
    np.testing.assert_array_equal(got["wav"], root[f"{item}/wav"][:, 8000:40000])
    np.testing.assert_array_equal(got["act"], root[f"{item}/act"][:, 50:250])
    assert zstore.cache_stats(cfg)["ram"]["corrupt"] > 0


def test_encoded_ram_hits_are_one_lookup_per_shard_per_process(small_store, tmp_path):
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram",
        ram_bytes="64MB",
        ram_format="encoded",
        ssd_dir=tmp_path / "ssd",
        ssd_bytes="64MB",
    )
    root = zarr.open_group(small_store, mode="r")
    item = sorted(root.group_keys())[4]
    reader = WindowReader(small_store, cache=cfg).open()
    reader.start_builds()  # past its first read, which asks for no fill
    spans = {"wav": Span(16000, 64000), "act": Span(100, 400)}
    reader.read(item, spans)  # fills the encoded shards behind the read
    assert reader.settle(timeout=120)
    reader.read(item, spans)  # maps them
    before = zstore.cache_stats(cfg)
    for _ in range(5):
        got = reader.read(item, spans)
    after = zstore.cache_stats(cfg)
    np.testing.assert_array_equal(got["wav"], root[f"{item}/wav"][:, 16000:64000])
    assert after["ssd"]["hits"] == before["ssd"]["hits"]  # no per-chunk lookups at all
    assert after["ram"]["misses"] == before["ram"]["misses"]
    assert after["ram"]["hits"] - before["ram"]["hits"] == 5 * 2  # one per shard per read


SPANS = {"act": Span(0, 100), "wav": Span(0, 16000)}


def full_decoded_tier(store, tmp_path):
    """A reader whose decoded RAM tier (3 MB) is filled by one read of every item but
    the last; the origin's group, the config, the reader and the items."""
    root = zarr.open_group(store, mode="r")
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram",
        ram_bytes="3MB",
        ram_format="decoded",
        ssd_dir=tmp_path / "ssd",
        ssd_bytes="64MB",
    )
    reader = WindowReader(store, cache=cfg)
    items = sorted(root.group_keys())
    for item in items[:-1]:  # fills behind the reads while there is room
        got = reader.read(item, SPANS)
        np.testing.assert_array_equal(got["wav"], root[f"{item}/wav"][:, :16000])
        np.testing.assert_array_equal(got["act"], root[f"{item}/act"][:, :100])
        assert reader.settle(timeout=120)
    return root, cfg, reader, items


def test_a_shard_that_displaces_others_is_built_behind_the_reads(
    small_store, tmp_path, monkeypatch
):
    """Once the RAM tier is full, a shard admission lets in is decoded into the tier by a
    background thread: the read that admitted it returns at once, from the chunks, with
    the right values, and once the build is done the shard's windows are RAM hits."""
    from zstore.read._builds import BehindBuilds

    submitted: list[str] = []
    real_submit = BehindBuilds.submit

    def submit(self, key, build, nbytes=0):
        if isinstance(key, str):  # a displacing build (fills hand over a list of keys)
            submitted.append(key)
        return real_submit(self, key, build, nbytes)

    monkeypatch.setattr(BehindBuilds, "submit", submit)
    root, cfg, reader, items = full_decoded_tier(small_store, tmp_path)

    def check(item):
        got = reader.read(item, SPANS)
        np.testing.assert_array_equal(got["wav"], root[f"{item}/wav"][:, :16000])
        np.testing.assert_array_equal(got["act"], root[f"{item}/act"][:, :100])

    assert not submitted
    last = items[-1]
    for _ in range(12):  # popular enough to displace residents
        check(last)
        assert reader.settle(timeout=120)
        if submitted:
            break
    assert submitted and all(last in key for key in submitted)
    stats = zstore.cache_stats(cfg)
    assert stats["ram"]["evictions"] > 0 and stats["ram"]["bytes_on_disk"] <= 3_000_000
    hits = stats["ram"]["hits"]
    check(last)  # now from the shard built behind
    assert zstore.cache_stats(cfg)["ram"]["hits"] > hits
    assert not reader.form.behind.pending


def test_a_failed_build_behind_the_reads_is_logged_and_reads_go_on(
    small_store, tmp_path, monkeypatch
):
    import logging
    import threading

    from zstore.read._ram_shards import DecodedShards

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    real_fill = DecodedShards.fill

    def broken(self, todo, need, raw):  # builds behind the reads fail; inline ones work
        if threading.current_thread().name.startswith("zstore-build"):
            raise OSError("disk full (simulated)")
        return real_fill(self, todo, need, raw)

    root, _, reader, items = full_decoded_tier(small_store, tmp_path)
    monkeypatch.setattr(DecodedShards, "fill", broken)
    records = Records()
    logging.getLogger("zstore").addHandler(records)
    try:
        for _ in range(12):
            got = reader.read(items[-1], SPANS)
            np.testing.assert_array_equal(got["wav"], root[f"{items[-1]}/wav"][:, :16000])
            assert reader.settle(timeout=120)
            if records.messages:
                break
    finally:
        logging.getLogger("zstore").removeHandler(records)
    assert any("disk full (simulated)" in m and items[-1] in m for m in records.messages)
    assert not reader.form.behind.pending


@pytest.mark.parametrize(
    "ram,ssd,expected",
    [
        (400 * GB, 200 * GB, "chunks"),  # the decoded data fits
        (100 * GB, 200 * GB, "chunks"),  # a third fits decoded; the SSD tier has the store
        (200 * GB, 0, "encoded"),  # no SSD tier: the compressed store fits RAM
        (100 * GB, 0, "chunks"),  # not even the compressed store fits: decoded share
    ],
)
def test_auto_format_choice_for_a_store_read_by_ranges(tmp_path, ram, ssd, expected):
    """Read by ranges (not fetched whole, not packed), the decoded form is the one the
    reads fill; the compressed form's choice is the same."""
    choice = choose(resolved(tmp_path, ram, ssd), 300 * GB, 155 * GB, whole_shards=False)
    assert choice.format == expected


def _inside_first_open(monkeypatch, module, name: str, other) -> list[threading.Thread]:
    """Run ``other`` in a thread of its own, to its end, from inside the first call of
    ``module.name`` (a step of an object's first open in this process): a second
    thread's first call arriving while the first thread is halfway, in a fixed order."""
    real = getattr(module, name)
    started: list[threading.Thread] = []

    def halfway(*args, **kwargs):
        if not started:
            started.append(threading.Thread(target=other))
            started[0].start()
            started[0].join(timeout=120)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, halfway)
    return started


def test_a_thread_never_sees_the_sketch_half_opened(tmp_path, monkeypatch):
    """A second thread's first touch while the first is opening the node's sketch is
    counted (it was dropped: the sketch looked unusable, or had counts and no width)."""
    import zstore.cache._admission as admission

    sketch = FrequencySketch(str(tmp_path), sketch_width(1 << 20))
    started = _inside_first_open(monkeypatch, admission, "sketch_bytes", lambda: sketch.touch("k"))
    sketch.touch("k")
    assert started and not started[0].is_alive()
    assert sketch.estimate("k") >= 2
    assert os.listdir(tmp_path) == ["frequency.bin"]  # no file left behind


def test_a_sketch_made_by_another_process_meanwhile_is_kept(tmp_path, monkeypatch):
    """Two processes making the node's sketch at once: the one made second does not
    replace the first (whose process would count into a file no one else reads).  The
    other process is a thread (a temporary name of its own) that makes and publishes its
    sketch while this one's is written but not yet in place."""
    import zstore.cache.files as files

    first = FrequencySketch(str(tmp_path), sketch_width(1 << 20))
    second = FrequencySketch(str(tmp_path), sketch_width(1 << 20))  # as another process
    started = _inside_first_open(monkeypatch, files, "fix_file", lambda: first.touch("k"))
    second.touch("k")
    first.touch("k")
    assert started and not started[0].is_alive()
    assert first.estimate("k") >= 2 and second.estimate("k") >= 2
    assert os.listdir(tmp_path) == ["frequency.bin"]


def test_a_thread_never_sees_the_eviction_log_half_opened(tmp_path, monkeypatch):
    """A second thread's eviction recorded while the first is opening the node's log is
    kept (it went unrecorded, and other processes kept the evicted file mapped)."""
    import zstore.cache._evictions as evictions

    log = evictions.EvictionLog(str(tmp_path))
    _inside_first_open(monkeypatch, evictions, "make_dir", lambda: log.record([7]))
    log.record([8])
    assert log.since(0) == (2, [7, 8])
