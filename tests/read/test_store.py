"""zarr's own Store conformance suite on the cached store, plus zarr's API through the tiers.

The cached store is read-only by design (a cache keyed by store id must never see
the store change under it), so the suite's write tests are replaced by tests that
writes are refused; reads, byte ranges, partial values and listings run as zarr
wrote them, with data placed directly in the origin.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.abc.store import RangeByteRequest
from zarr.core.buffer import cpu, default_buffer_prototype
from zarr.testing.store import StoreTests

import zstore
from zstore.read._zarr_store import CachedStore

READ_ONLY = "store was opened in read-only mode and does not support writing"


class TestCachedStoreConformance(StoreTests[CachedStore, cpu.Buffer]):
    store_cls = CachedStore
    buffer_cls = cpu.Buffer

    async def set(self, store: CachedStore, key: str, value: cpu.Buffer) -> None:
        path = Path(store.url) / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(value.to_bytes())

    async def get(self, store: CachedStore, key: str) -> cpu.Buffer:
        return self.buffer_cls.from_bytes((Path(store.url) / key).read_bytes())

    @pytest.fixture
    def store_kwargs(self, tmp_path: Path) -> dict:
        (tmp_path / "origin").mkdir()
        cache = zstore.CacheConfig(
            ram_dir=tmp_path / "ram", ram_bytes="16MB", ssd_dir=tmp_path / "ssd", ssd_bytes="16MB"
        )
        return {"url": str(tmp_path / "origin"), "store_id": "conformance", "cache": cache}

    def test_store_repr(self, store: CachedStore) -> None:
        assert repr(store).startswith("CachedStore(") and "conformance" in repr(store)

    def test_store_supports_writes(self, store: CachedStore) -> None:
        assert not store.supports_writes and not store.supports_deletes

    def test_store_supports_listing(self, store: CachedStore) -> None:
        assert store.supports_listing

    def test_store_read_only(self, store: CachedStore) -> None:
        assert store.read_only
        with pytest.raises(AttributeError):
            store.read_only = False  # type: ignore[misc]

    @pytest.mark.parametrize("read_only", [True, False])
    async def test_store_open_read_only(self, open_kwargs: dict, read_only: bool) -> None:
        if read_only:
            store = await self.store_cls.open(**{**open_kwargs, "read_only": True})
            assert store._is_open and store.read_only
        else:
            with pytest.raises(ValueError, match="read-only"):
                await self.store_cls.open(**{**open_kwargs, "read_only": False})

    async def test_serializable_store(self, store: CachedStore) -> None:
        new_store = pickle.loads(pickle.dumps(store))
        assert new_store == store and new_store.read_only
        await self.set(store, "foo", self.buffer_cls.from_bytes(b"\x01\x02\x03\x04"))
        observed = await new_store.get("foo", prototype=default_buffer_prototype())
        assert observed.to_bytes() == b"\x01\x02\x03\x04"

    async def test_with_read_only_store(self, open_kwargs: dict) -> None:
        store = await self.store_cls.open(**open_kwargs)
        assert store.with_read_only(True).read_only
        with pytest.raises(ValueError, match="read-only"):
            store.with_read_only(False)

    @pytest.mark.parametrize("key", ["zarr.json", "c/0"])
    async def test_set(self, store: CachedStore, key: str) -> None:
        with pytest.raises(ValueError, match=READ_ONLY):
            await store.set(key, self.buffer_cls.from_bytes(b"x"))
        assert not (Path(store.url) / key).exists()

    async def test_set_not_open(self, store_not_open: CachedStore) -> None:
        with pytest.raises(ValueError, match=READ_ONLY):
            await store_not_open.set("c/0", self.buffer_cls.from_bytes(b"x"))

    async def test_set_many(self, store: CachedStore) -> None:
        with pytest.raises(ValueError, match=READ_ONLY):
            await store._set_many([("c/0", self.buffer_cls.from_bytes(b"x"))])

    async def test_set_if_not_exists(self, store: CachedStore) -> None:
        with pytest.raises(ValueError, match=READ_ONLY):
            await store.set_if_not_exists("k", self.buffer_cls.from_bytes(b"x"))

    def test_set_sync(self, store: CachedStore) -> None:
        assert not hasattr(store, "set_sync")

    async def test_clear(self, store: CachedStore) -> None:
        await self.set(store, "key", self.buffer_cls.from_bytes(b"something"))
        with pytest.raises(ValueError, match=READ_ONLY):
            await store.clear()
        assert (Path(store.url) / "key").exists()

    async def test_getsize_prefix(self, store: CachedStore) -> None:
        for k in ["c/0/0", "c/0/1", "c/1/0", "c/1/1"]:
            await self.set(store, k, self.buffer_cls.from_bytes(b"\x01\x02\x03\x04"))
        assert await store.getsize_prefix("c") == 16

    async def test_exists(self, store: CachedStore) -> None:
        assert not await store.exists("foo")
        await self.set(store, "foo/zarr.json", self.buffer_cls.from_bytes(b"bar"))
        assert await store.exists("foo/zarr.json")

    async def _put(self, store: CachedStore, keys: list[str]) -> None:
        for k in keys:
            await self.set(store, k, self.buffer_cls.from_bytes(b""))

    async def test_list(self, store: CachedStore) -> None:
        assert [k async for k in store.list()] == []
        keys = ["foo/zarr.json"] + [f"foo/c/{i}" for i in range(10)]
        await self._put(store, keys)
        assert sorted([k async for k in store.list()]) == sorted(keys)

    async def test_list_prefix(self, store: CachedStore) -> None:
        await self._put(store, ["zarr.json", "a/zarr.json", "a/b/zarr.json", "a/b/c/zarr.json"])
        assert sorted([k async for k in store.list_prefix("a/b")]) == [
            "a/b/c/zarr.json",
            "a/b/zarr.json",
        ]

    async def test_list_empty_path(self, store: CachedStore) -> None:
        await self._put(store, ["foo/bar/zarr.json", "foo/bar/c/1", "foo/baz/c/0"])
        assert sorted([k async for k in store.list_prefix("")]) == [
            "foo/bar/c/1",
            "foo/bar/zarr.json",
            "foo/baz/c/0",
        ]

    async def test_list_dir(self, store: CachedStore) -> None:
        await self._put(store, ["zarr.json", "foo/zarr.json", "foo/c/0", "foo/c/1"])
        assert sorted([k async for k in store.list_dir("foo")]) == ["c", "zarr.json"]
        assert sorted([k async for k in store.list_dir("")]) == ["foo", "zarr.json"]

    async def test_get_is_cached(self, store: CachedStore) -> None:
        await self.set(store, "c/0", self.buffer_cls.from_bytes(b"0123456789"))
        first = await store.get("c/0", default_buffer_prototype(), RangeByteRequest(2, 6))
        (Path(store.url) / "c/0").write_bytes(b"changed!!!")  # the origin changes under it
        again = await store.get("c/0", default_buffer_prototype(), RangeByteRequest(2, 6))
        assert first.to_bytes() == again.to_bytes() == b"2345"
        stats = zstore.cache_stats(store.cache)
        assert stats["origin"]["requests"] == 1 and stats["ram"]["hits"] == 1


def test_zarr_api_through_the_tiers(small_store, cache):
    plain = zarr.open_group(small_store, mode="r")
    for attempt in range(2):
        cached = zarr.open_group(zstore.open_store(small_store, cache=cache), mode="r")
        for item in ("utt000000", "utt000003"):
            for name in ("wav", "act"):
                np.testing.assert_array_equal(
                    cached[f"{item}/{name}"][..., 5:333], plain[f"{item}/{name}"][..., 5:333]
                )
        if attempt == 0:
            cold = zstore.cache_stats(cache)["origin"]["requests"]
    stats = zstore.cache_stats(cache)
    assert cold > 0 and stats["origin"]["requests"] == cold  # second pass: all from the tiers
    assert stats["ram"]["hits"] > 0


def test_open_store_without_manifest_reads_uncached(tmp_path):
    zarr.create_array(tmp_path / "plain.zarr", shape=(10,), dtype="i4")[...] = np.arange(10)
    with pytest.warns(UserWarning, match="no zstore manifest"):
        store = zstore.open_store(str(tmp_path / "plain.zarr"))
    assert store.tiers is None
    np.testing.assert_array_equal(zarr.open_array(store, mode="r")[...], np.arange(10))


def test_open_store_needs_a_zarr_store(tmp_path):
    with pytest.raises(zstore.StoreFormatError, match="no zarr.json"):
        zstore.open_store(str(tmp_path))


def test_a_store_path_that_does_not_exist_says_so(tmp_path):
    missing = tmp_path / "typo" / "speech.zarr"
    with pytest.raises(zstore.StoreFormatError, match="no such directory; check the path"):
        zstore.WindowDataset(missing)
    with pytest.raises(zstore.StoreFormatError, match="no such directory"):
        zstore.open_store(str(missing))
