"""The window reader against zarr's own indexing: every layout, cache mode and edge."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr
from conftest import edit_header, write_h5

import zstore
import zstore.read._origin_fetch
from zstore.format.layout import MANIFEST_ATTR, Span
from zstore.read._origin_fetch import COALESCE_BYTES, coalesce
from zstore.read.reader import WindowReader
from zstore.testing import ModelledFileSystem

MODES = {
    "no-cache": False,
    "decoded-ram": dict(ram_format="decoded"),
    "encoded-ram": dict(ram_format="encoded"),
    "ssd-only": dict(ram_bytes=0, fetch="range"),
    "shard-fetch": dict(fetch="shard"),
}


def config(tmp_path, mode, **overrides):
    if MODES[mode] is False:
        return None
    base = dict(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=tmp_path / "ssd", ssd_bytes="64MB"
    )
    return zstore.CacheConfig(**{**base, **MODES[mode], **overrides})


def random_spans(root, item, rng, n=6):
    length = root[f"{item}/act"].shape[-1]
    spans = [(0, 1), (0, length), (max(0, length - 7), length), (99, 101), (100, 200)]
    for _ in range(n):
        a = int(rng.integers(0, length))
        spans.append((a, int(rng.integers(a, length + 1))))
    return [(a, b) for a, b in spans if b <= length]


@pytest.mark.parametrize("mode", list(MODES))
def test_reader_equals_zarr(small_store, tmp_path, mode):
    root = zarr.open_group(small_store, mode="r")
    items = list(root.group_keys())
    reader = WindowReader(small_store, cache=config(tmp_path, mode))
    rng = np.random.default_rng(0)
    for _repeat in range(2):  # cold, then through whatever the tiers hold
        for item in items:
            for a, b in random_spans(root, item, rng):
                got = reader.read(item, {"act": Span(a, b), "wav": Span(a * 160, b * 160)})
                np.testing.assert_array_equal(got["act"], root[f"{item}/act"][:, a:b])
                np.testing.assert_array_equal(got["wav"], root[f"{item}/wav"][:, a * 160 : b * 160])
    wav = root[f"{items[0]}/wav"]
    tail = reader.read(items[0], {"wav": Span(wav.shape[1] - 5, wav.shape[1], pad=3)})["wav"]
    np.testing.assert_array_equal(tail[:, :5], wav[:, -5:])
    assert not tail[:, 5:].any()


def test_whole_arrays_and_static_arrays(tmp_path):
    rng = np.random.default_rng(1)
    items = {
        f"u{i}": {
            "wav": rng.standard_normal((2, n)).astype(np.float32),
            "act": np.zeros((1, n // 160), np.float32),  # all-zero: empty chunks
            "emb": rng.standard_normal(8).astype(np.float32),
        }
        for i, n in enumerate([16000 * 3 + 17, 800])
    }
    src = write_h5(tmp_path / "s.h5", items)
    zstore.convert(src, tmp_path / "s.zarr", rates={"wav": 16000}, workers=1, progress=False)
    reader = WindowReader(str(tmp_path / "s.zarr"), cache=config(tmp_path, "decoded-ram"))
    for name, arrays in items.items():
        got = reader.read(name, {"wav": None, "act": Span(0, arrays["act"].shape[1]), "emb": None})
        for k in arrays:
            np.testing.assert_array_equal(got[k], arrays[k])


def _rewrite(store, path, data, **kw):
    """Replace an array with another layout, and say so in the header (a null dtype:
    read each item's own zarr.json), as a tool that rewrites arrays must."""
    root = zarr.open_group(store, mode="r+", use_consolidated=False)
    attrs = dict(root[path].attrs)
    del root[path]
    arr = root.create_array(path, shape=data.shape, dtype=data.dtype, **kw)
    arr[...] = data
    arr.attrs.update(attrs)
    name = path.rsplit("/", 1)[1]
    edit_header(
        store,
        lambda h: {**h, "arrays": {**h["arrays"], name: {**h["arrays"][name], "dtype": None}}},
    )


@pytest.mark.parametrize(
    "layout",
    [
        dict(chunks=(2, 16000)),  # unsharded, fast path
        dict(chunks=(1, 4000)),  # non-time axis chunked: zarr fallback
        dict(
            chunks=(2, 8000), shards=(2, 32000), compressors=[zarr.codecs.GzipCodec()]
        ),  # fallback
    ],
)
def test_other_layouts(small_store, tmp_path, layout):
    import shutil

    store = str(tmp_path / "copy.zarr")
    shutil.copytree(small_store, store)
    original = zarr.open_group(small_store, mode="r")["utt000001/wav"][...]
    _rewrite(store, "utt000001/wav", original, **layout)
    assert MANIFEST_ATTR in dict(zarr.open_group(store, mode="r").attrs)
    reader = WindowReader(store, cache=config(tmp_path, "decoded-ram"))
    fast = reader.layout("utt000001", "wav").fast
    assert fast == ("compressors" not in layout and layout["chunks"][0] == 2)
    for a, b in [(0, 5), (15990, 32010), (original.shape[1] - 100, original.shape[1])]:
        for _ in range(2):
            got = reader.read("utt000001", {"wav": Span(a, b)})["wav"]
            np.testing.assert_array_equal(got, original[:, a:b])


def test_window_is_one_batch_of_origin_requests(small_store, tmp_path):
    fs = ModelledFileSystem(latency=0.05)  # S3-like: requests must overlap, not queue
    cfg = config(tmp_path, "ssd-only")  # no RAM tier: just the window's chunks
    reader = WindowReader(small_store, cache=cfg, origin_fs=fs)
    reader.open()
    fs.reset_counts()
    a = 150
    reader.read("utt000002", {"act": Span(a, a + 200), "wav": Span(a * 160, (a + 200) * 160)})
    # 2 shard indexes together, then the 3 one-second chunks of each array together, as
    # one merged byte range per array (they lie next to each other in the shard)
    first = fs.data_requests
    assert first == 2 + 1 + 1
    assert fs.root_requests == 1  # the store's root, checked beside the chunks (_replaced)
    assert fs.max_in_flight >= 2
    reader.read("utt000002", {"act": Span(a, a + 200), "wav": Span(a * 160, (a + 200) * 160)})
    assert fs.data_requests == first  # all from the tiers now


def test_origin_bytes_near_the_compressed_window(small_store, tmp_path):
    fs = ModelledFileSystem()
    reader = WindowReader(small_store, cache=config(tmp_path, "ssd-only"), origin_fs=fs)
    reader.open()
    fs.reset_counts()
    layout = reader.layout("utt000003", "wav")
    index = reader.source.index([(layout, 0)])[layout.object_key(0)]
    needed = int(sum(index[k][1] for k in range(2, 4)))  # 2 s window on the chunk grid
    fs.reset_counts()
    reader.read("utt000003", {"wav": Span(32000, 64000)})
    assert fs.data_bytes == needed


def test_auto_fetch_keeps_a_network_file_system_store_in_the_ssd_tiers_slots(
    small_store, tmp_path, monkeypatch
):
    """A store on NFS (a mounted path) is read as a remote one: with an SSD tier, each
    chunk the reads fetch goes into its shard's slotted value (one value per shard);
    its round trip is short, so by ranges, not whole shards.  On a local disk, ranges
    and no slots."""
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=tmp_path / "ssd", ssd_bytes="256MB"
    )
    local = WindowReader(small_store, cache=cfg).open()
    assert local.fetch == "range" and local.source.slotted is None
    real = zstore.urls.filesystem_type
    monkeypatch.setattr(
        "zstore.urls.filesystem_type",
        lambda path: "nfs4" if path.startswith(small_store) else real(path),
    )
    ssd_only = zstore.CacheConfig(
        ram_dir=None, ram_bytes=0, ssd_dir=tmp_path / "ssd-only", ssd_bytes="256MB"
    )
    reader = WindowReader(small_store, cache=ssd_only).open()
    assert reader.fetch == "slots" and reader.source.slotted is not None
    reader.start_builds()  # past the node's first reads, which write nothing
    wav = zarr.open_group(small_store, mode="r")["utt000001/wav"]
    got = reader.read("utt000001", {"wav": Span(8000, 40000)})["wav"]
    np.testing.assert_array_equal(got, wav[:, 8000:40000])
    assert reader.settle(timeout=120)
    ssd = zstore.cache_stats(ssd_only)["ssd"]
    assert ssd["entries"] == 1 and ssd["fills"] >= 3  # the shard's value: 3 chunks in it


@pytest.mark.parametrize("fetch", ["range", "shard"])
def test_fetch_modes_same_data_expected_requests(small_store, tmp_path, fetch, monkeypatch):
    monkeypatch.setattr(zstore.read._origin_fetch, "COALESCE_BYTES", 2**30)  # one range per shard
    fs = ModelledFileSystem()
    cfg = config(tmp_path, "decoded-ram", fetch=fetch)
    reader = WindowReader(small_store, cache=cfg, origin_fs=fs)
    plain = zarr.open_group(small_store, mode="r")["utt000004/wav"]
    reader.open()
    fs.reset_counts()
    first = reader.read("utt000004", {"wav": Span(0, 16000 * 2)})["wav"]
    served = fs.data_requests
    assert reader.settle(timeout=120)  # the shard's build behind the first read is done
    second = reader.read("utt000004", {"wav": Span(16000 * 2, plain.shape[1])})["wav"]
    np.testing.assert_array_equal(np.concatenate([first, second], axis=1), plain[...])
    n_chunks = -(-plain.shape[1] // 16000)
    shard = os.path.getsize(f"{small_store}/utt000004/wav/c/0/0")
    if fetch == "shard":
        assert fs.data_requests == 1  # the whole shard once; every chunk then from the tiers
        assert fs.data_bytes == shard
    else:  # the index, the window's chunks, then (behind the read, to build the decoded
        # shard) its other chunks, each as one merged range: every byte once.  (A later
        # read fetches a new shard's other chunks in its own round: test_fill_behind.py)
        assert n_chunks > 2 and served == 1 + 1 and fs.data_requests == 1 + 2
        assert fs.data_bytes == shard


def test_coalesce_merges_adjacent_ranges_up_to_the_limit():
    requests = [
        ("a", 100, 200),
        ("a", 0, 100),
        ("b", 0, 50),
        ("a", 200, 350),
        ("a", 400, 450),
        ("a", -16, None),
        ("c", None, None),
    ]
    merged, parts = coalesce(requests, 300)
    assert merged == [
        ("a", 0, 200),
        ("a", 200, 350),
        ("a", 400, 450),
        ("b", 0, 50),
        ("a", -16, None),
        ("c", None, None),
    ]
    assert parts == [
        (0, 100, 100),
        (0, 0, 100),
        (3, 0, 50),
        (1, 0, 150),
        (2, 0, 50),
        (4, 0, None),
        (5, 0, None),
    ]
    objects = {"a": bytes(range(256)) * 2, "b": b"b" * 64, "c": b"c" * 8}

    def read(key, start, stop):
        data = objects[key]
        return data[start:] if stop is None else data[start:stop]

    datas = [read(*r) for r in merged]
    for r, (m, offset, n) in zip(requests, parts):
        got = datas[m] if n is None else datas[m][offset : offset + n]
        assert got == read(*r)


def test_coalescing_limit_splits_ranges_same_data(small_store, tmp_path, monkeypatch):
    fs = ModelledFileSystem()
    plain = zarr.open_group(small_store, mode="r")["utt000004/wav"]
    n_chunks = -(-plain.shape[1] // 16000)
    shard_bytes = os.path.getsize(f"{small_store}/utt000004/wav/c/0/0")
    for limit in (1, 256 * 1024, COALESCE_BYTES, 2**30):
        monkeypatch.setattr(zstore.read._origin_fetch, "COALESCE_BYTES", limit)
        reader = WindowReader(small_store, origin_fs=fs).open()  # no tiers: all from origin
        fs.reset_counts()
        got = reader.read("utt000004", {"wav": Span(0, plain.shape[1])})["wav"]
        np.testing.assert_array_equal(got, plain[...])
        assert fs.data_bytes == shard_bytes  # the same bytes, in fewer requests
        ranges = fs.data_requests - 1  # after the index
        if limit == 1:
            assert ranges == n_chunks
        elif limit >= shard_bytes:
            assert ranges == 1
        else:
            assert -(-shard_bytes // limit) <= ranges < n_chunks


def test_decoded_ram_tier_builds_whole_shards_once(small_store, tmp_path, monkeypatch):
    monkeypatch.setattr(zstore.read._origin_fetch, "COALESCE_BYTES", 2**30)  # one range per shard
    fs = ModelledFileSystem(latency=0.05)  # requests overlap, even on a loaded machine
    cfg = config(tmp_path, "decoded-ram", fetch="range")
    reader = WindowReader(small_store, cache=cfg, origin_fs=fs).open()
    reader.start_builds()  # past its first read, which asks for no build
    root = zarr.open_group(small_store, mode="r")
    wav, act = root["utt000005/wav"], root["utt000005/act"]
    fs.reset_counts()
    got = reader.read("utt000005", {"wav": Span(16000, 48000), "act": Span(100, 300)})
    assert reader.settle(timeout=120)  # the builds handed to the thread behind the read
    # both indexes, the window's chunks (one merged range per shard), then behind the
    # read the shards' other chunks: every byte of both shards once
    shards = [f"{small_store}/utt000005/{n}/c/0/0" for n in ("wav", "act")]
    assert fs.data_bytes == sum(os.path.getsize(p) for p in shards)
    assert 2 + 2 <= fs.data_requests <= 2 + 2 + 2
    assert fs.max_in_flight >= 2
    np.testing.assert_array_equal(got["wav"], wav[:, 16000:48000])
    other = WindowReader(small_store, cache=cfg, origin_fs=fs).open()  # as another process
    fs.reset_counts()
    fills = zstore.cache_stats(cfg)["ram"]["fills"]
    for a in (0, 57, act.shape[1] - 101):
        got = other.read(
            "utt000005", {"wav": Span(a * 160, (a + 100) * 160), "act": Span(a, a + 100)}
        )
        np.testing.assert_array_equal(got["wav"], wav[:, a * 160 : (a + 100) * 160])
        np.testing.assert_array_equal(got["act"], act[:, a : a + 100])
    assert fs.data_requests == 0
    stats = zstore.cache_stats(cfg)
    assert stats["ram"]["fills"] == fills  # served from the shards the first reader built
    assert stats["ram"]["entries"] >= 2 and stats["ram"]["hits"] >= 6


def test_corrupt_decoded_shards_are_dropped_and_rebuilt(small_store, tmp_path):
    cfg = config(tmp_path, "decoded-ram")
    root = zarr.open_group(small_store, mode="r")
    item = "utt000001"
    wav = root[f"{item}/wav"]
    first = WindowReader(small_store, cache=cfg).open()
    first.start_builds()  # past its first read, which asks for no build
    first.read(item, {"wav": Span(0, wav.shape[1])})
    assert first.settle(timeout=120)  # its shard, filled behind the read, is in
    shards = [f for f in (tmp_path / "ram").rglob("*.val") if f.stat().st_size > 100_000]
    assert shards
    for f in shards:
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0x01  # one flipped bit in the payload
        f.write_bytes(bytes(raw))
    fresh = WindowReader(small_store, cache=cfg)  # as another process: maps the files
    for a, b in [(0, 16000), (0, wav.shape[1]), (16000, 48000)]:
        np.testing.assert_array_equal(fresh.read(item, {"wav": Span(a, b)})["wav"], wav[:, a:b])
    assert zstore.cache_stats(cfg)["ram"]["corrupt"] >= 1


def test_shards_larger_than_the_ram_budget_read_only_the_window(small_store, tmp_path):
    fs = ModelledFileSystem()
    cfg = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="1MB", ssd_dir=None, fetch="range")
    reader = WindowReader(small_store, cache=cfg, origin_fs=fs).open()
    root = zarr.open_group(small_store, mode="r")
    item = max(root.group_keys(), key=lambda k: root[f"{k}/wav"].nbytes)
    wav = root[f"{item}/wav"]
    assert wav.nbytes > 1_000_000  # its decoded shard cannot fit
    fs.reset_counts()
    got = reader.read(item, {"wav": Span(16000, 32000)})["wav"]
    np.testing.assert_array_equal(got, wav[:, 16000:32000])
    assert fs.data_requests == 2  # the index and one chunk, not the whole shard
    assert zstore.cache_stats(cfg)["ram"]["bypassed"] == 0


def mapped_path(key):
    """'<store id>/<item>/<array>/c/0/0#D' -> '<item>/<array>'."""
    return key.split("/", 1)[1].rsplit("/c/", 1)[0]


def fill_past_budget(reader, items):
    """Another process reads other items, often enough that admission lets them displace
    what is resident (a new item used once never displaces anything)."""
    for _ in range(12):
        for item in items:
            reader.read(item, {"act": Span(0, 100), "wav": Span(0, 16000)})
    assert reader.settle(timeout=120)  # the shards it built behind its reads are in


def test_maps_of_shards_evicted_elsewhere_are_dropped(small_store, tmp_path):
    cfg = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="3MB", ssd_dir=None)
    root = zarr.open_group(small_store, mode="r")
    items = sorted(root.group_keys())
    a, b = WindowReader(small_store, cache=cfg), WindowReader(small_store, cache=cfg)
    for _ in range(2):  # the second read maps what the first built
        a.read(items[0], {"act": Span(0, 100), "wav": Span(0, 16000)})
        assert a.settle(timeout=120)
    assert {mapped_path(k) for k in a.values.maps} == {f"{items[0]}/act", f"{items[0]}/wav"}
    fill_past_budget(b, items[1:])
    assert zstore.cache_stats(cfg)["ram"]["evictions"] > 0
    got = a.read(items[0], {"act": Span(0, 100), "wav": Span(0, 16000)})
    np.testing.assert_array_equal(got["wav"], root[f"{items[0]}/wav"][:, :16000])
    for m in a.values.maps.values():  # every map left is of a live file
        assert os.stat(m.path).st_ino == m.ino
    assert zstore.cache_stats(cfg)["ram"]["bytes_on_disk"] <= 3_000_000


def test_an_idle_process_unmaps_shards_evicted_elsewhere(small_store, tmp_path):
    import threading

    cfg = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="3MB", ssd_dir=None)
    items = sorted(zarr.open_group(small_store, mode="r").group_keys())
    a, b = WindowReader(small_store, cache=cfg), WindowReader(small_store, cache=cfg)
    for _ in range(2):  # the second read maps what the first built
        a.read(items[0], {"act": Span(0, 100), "wav": Span(0, 16000)})
        assert a.settle(timeout=120)
    mapped = set(a.values.maps)
    assert mapped
    fill_past_budget(b, items[1:])
    assert any(t.name == "zstore-unmap" for t in threading.enumerate())
    # a reads nothing more; its unmapping thread drops what b evicted. Synchronize on its
    # lock and position in the eviction log, not on time: wait for the thread to catch up.
    head = a.tiers.ram.evictions.head()
    done = threading.Event()
    while not done.wait(0.05):
        with a.values.lock:
            if a.values.evicted_seen == head:
                done.set()
    for m in a.values.maps.values():
        assert os.stat(m.path).st_ino == m.ino
    assert set(a.values.maps) < mapped  # what was evicted is no longer mapped


def test_a_store_on_a_local_disk_goes_without_the_default_ssd_tier(
    small_store, tmp_path, monkeypatch
):
    """The default SSD directory serves stores behind a URL, a network file system or
    another origin; a store on a local disk is read from it directly, by the reader and
    by zstore.open_store alike. A directory named in the config or in ZSTORE_SSD_DIR is
    used whatever the store."""
    from zstore import urls
    from zstore.testing import ModelledFileSystem

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("ZSTORE_SSD_DIR", raising=False)
    auto = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="64MB")

    def ssd(cfg, **kwargs):
        reader = WindowReader(small_store, cache=cfg, **kwargs).open()
        reader.read("utt000002", {"wav": Span(0, 16000)})  # reads as before
        tier = reader.tiers.ssd
        if not kwargs:  # zarr's view through the tiers: the same ones
            other = zstore.open_store(small_store, cache=cfg).tiers.ssd
            assert (other is None) is (tier is None)
            assert other is None or other.directory == tier.directory
        return None if tier is None else tier.directory

    for local in ("ext4", "xfs", "tmpfs"):  # whatever this machine's /tmp is
        monkeypatch.setattr(urls, "filesystem_type", lambda path, kind=local: kind)
        assert ssd(auto) is None
    named = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=tmp_path / "s")
    assert ssd(named) == str(tmp_path / "s")
    monkeypatch.setenv("ZSTORE_SSD_DIR", str(tmp_path / "env"))
    assert ssd(auto) == str(tmp_path / "env")
    monkeypatch.delenv("ZSTORE_SSD_DIR")
    assert str(ssd(auto, origin_fs=ModelledFileSystem())).startswith(str(tmp_path / "xdg"))
    for remote in ("nfs4", "fuse.mountpoint-s3", ""):  # network, FUSE, unknown
        monkeypatch.setattr(urls, "filesystem_type", lambda path, kind=remote: kind)
        assert str(ssd(auto)).startswith(str(tmp_path / "xdg"))


@pytest.mark.parametrize("fs_type", ["ext4", "nfs4"])
def test_shard_indexes_stay_out_of_the_ram_tier_for_a_store_on_a_local_disk(
    small_store, tmp_path, monkeypatch, fs_type
):
    """A store on a local disk reads a shard's index (~1 KiB) from the page cache: it is
    not put in the RAM tier (a lookup and a write transaction on each shard's first
    touch).  A store on a network file system keeps its indexes there, so the node reads
    each once; either way the window and the shards the tier builds are the same."""
    from zstore import urls

    store = os.path.abspath(small_store)
    monkeypatch.setattr(  # the store's file system; the tier's stays a local one
        urls, "filesystem_type", lambda path: fs_type if path.startswith(store) else "ext4"
    )
    cfg = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=None)
    reader = WindowReader(small_store, cache=cfg).open()
    assert reader.origin.local_disk is (fs_type == "ext4")
    assert reader.format_choice is not None and reader.format_choice.format == "chunks"
    want = zarr.open_group(small_store, mode="r")["utt000002/wav"][:, 16000:48000]
    spans = {"wav": Span(16000, 48000), "act": Span(100, 300)}
    for _ in range(2):  # the first read writes nothing in the tier; the second does
        np.testing.assert_array_equal(reader.read("utt000002", spans)["wav"], want)
    assert reader.settle(timeout=120)
    keys = [k for k in reader.tiers.ram._open().iterkeys()]
    indexes = [k for k in keys if "#s" in k]
    assert len(indexes) == (0 if fs_type == "ext4" else len(spans))
    assert len(keys) - len(indexes) == len(spans)  # the two shards
    before = zstore.cache_stats(cfg)["ram"]
    np.testing.assert_array_equal(reader.read("utt000002", spans)["wav"], want)
    after = zstore.cache_stats(cfg)["ram"]
    assert after["misses"] == before["misses"] and after["hits"] > before["hits"]  # all hits
