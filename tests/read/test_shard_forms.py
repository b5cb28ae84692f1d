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
        out = [ds[i] for i in range(len(ds))]
        assert ds.settle(timeout=120)  # the shards filled behind these reads are in
        return out

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

    def test_a_shard_built_elsewhere_during_a_batch_is_read_once(self, small_store, cache):
        """A batch's first window reads its chunks and hands its shard to the build
        behind the reads; the shard is in the tier (built by another process) before the
        batch's next window of it is planned.  Every window is still one copy of each
        sample: the batch decides once per shard where it reads it from."""
        from zstore.format import Span
        from zstore.read import WindowReader

        reader = WindowReader(small_store, cache=cache).open()
        reader.start_builds()  # past its first read, which asks for no build
        form = reader.form
        if form is None:
            pytest.skip("no RAM tier: no shards")
        root = zarr.open_group(small_store, mode="r")
        item = next(k for k in sorted(root.group_keys()) if root[f"{k}/wav"].shape[1] >= 48000)
        other = WindowReader(small_store, cache=cache)
        built = []

        def built_elsewhere(key, build):
            other.read(item, {"wav": Span(0, 16000)})  # a whole-shard build, another reader
            built.append(key)
            return True

        form.later = True  # every form: a shard that displaces others is built behind
        form.ram.admits_as = lambda key, nbytes, blocked=False: "displace"
        form.behind.submit = built_elsewhere
        spans = [Span(0, 16000), Span(16000, 32000), Span(8000, 48000)]
        wav = root[f"{item}/wav"]
        outs = [{"wav": np.empty((wav.shape[0], s.stop - s.start), wav.dtype)} for s in spans]
        reader.read_batch([(item, {"wav": s}, None) for s in spans], outs)
        assert built
        for s, out in zip(spans, outs):
            np.testing.assert_array_equal(out["wav"], wav[:, s.start : s.stop])


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
