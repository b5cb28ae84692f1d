"""The contract of the RAM tier's shard forms (decoded, encoded) and of the two ways
chunks reach a reader (``fetch="range"``, ``fetch="shard"``): every window equals the
store read by zarr, cold and warm; warm reads are RAM hits; a window never reaches past
an item's end."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

import zstore


class ReadPathContract:
    """Subclasses set the cache options of one read path."""

    options: dict = {}

    @pytest.fixture
    def cache(self, tmp_path):
        base = dict(
            ram_dir=tmp_path / "ram", ram_bytes="256MB", ssd_dir=tmp_path / "ssd", ssd_bytes="256MB"
        )
        return zstore.CacheConfig(**{**base, **self.options})

    def windows(self, store, cache, epoch):
        ds = zstore.WindowDataset(
            store,
            window_seconds=1.5,
            seed=11,
            windows_per_item=3,
            cache=cache,
            fields=["wav", "act"],
        )
        ds.set_epoch(epoch)
        return [ds[i] for i in range(len(ds))]

    def test_windows_equal_the_store_cold_and_warm(self, small_store, cache):
        root = zarr.open_group(small_store, mode="r")
        for epoch in (0, 0, 1):  # cold, the same windows warm, other windows
            for w in self.windows(small_store, cache, epoch):
                start, n = round(w["start"] * 100), int(w["length"])  # act frames
                want = root[w["item"]]["act"][:, start : start + n]
                assert n > 0 and np.array_equal(w["act"].numpy()[:, :n], want)
                wav = root[w["item"]]["wav"][:, start * 160 : (start + n) * 160]
                assert np.array_equal(w["wav"].numpy()[:, : n * 160], wav)

    def test_warm_reads_are_ram_hits(self, small_store, cache):
        self.windows(small_store, cache, 0)
        before = zstore.cache_stats(cache)["ram"]["hits"]
        self.windows(small_store, cache, 0)
        assert zstore.cache_stats(cache)["ram"]["hits"] > before


class TestDecodedShards(ReadPathContract):
    options = {"ram_format": "decoded"}


class TestEncodedShards(ReadPathContract):
    options = {"ram_format": "encoded"}


class TestRangeFetch(ReadPathContract):
    options = {"ram_bytes": 0, "fetch": "range"}

    def test_warm_reads_are_ram_hits(self, small_store, cache):
        self.windows(small_store, cache, 0)
        before = zstore.cache_stats(cache)["ssd"]["hits"]
        self.windows(small_store, cache, 0)
        assert zstore.cache_stats(cache)["ssd"]["hits"] > before  # no RAM tier: SSD hits


class TestShardFetch(ReadPathContract):
    options = {"fetch": "shard"}
