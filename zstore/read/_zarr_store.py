"""``open_store``: a read-only zarr v3 Store with the node-shared cache tiers in front of the origin.

Every read zarr makes goes through the tiers -- whole objects, byte ranges
(``get``), ``get_partial_values`` and ``get_sync`` -- so sharded reads, which
fetch one byte range per inner chunk, are cached too.  Cache keys are
``<store id>/<key>#<byte range>``; the reader in :mod:`zstore.read.reader` uses the
same keys, so both paths share cached bytes.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from zstore.cache import CacheConfig, TieredCache, as_cache_config
from zstore.format import MANIFEST_ATTR, append_ids, cache_namespace, read_manifest, read_root
from zstore.origin import Origin
from zstore.read._origin_fetch import range_key
from zstore.read._replaced import ROOT, StoreCheck
from zstore.urls import is_url, zarr_store

#: an object read whole as the range from its first byte: one request, where s3fs reads
#: a whole object with a HEAD for its size first (two round trips in every round)
WHOLE = OffsetByteRequest(0)

_READ_ONLY = "store was opened in read-only mode and does not support writing"


def tier_key(key: str, byte_range: ByteRequest | None) -> str:
    """The tiers' key of ``byte_range`` of object ``key``: a range as the reads by ranges
    name it (:func:`zstore.read._origin_fetch.range_key`: a value one kept is found by
    the other), ``#o<offset>`` from an offset, ``#s<n>`` for the last ``n`` bytes (a
    shard's index, as :func:`zstore.read._origin_fetch.index_key` names it); the key
    itself for the whole object."""
    if byte_range is None:
        return key
    if isinstance(byte_range, RangeByteRequest):
        return range_key(key, byte_range.start, byte_range.end)
    if isinstance(byte_range, OffsetByteRequest):
        return f"{key}#o{byte_range.offset}"
    if isinstance(byte_range, SuffixByteRequest):
        return f"{key}#s{byte_range.suffix}"
    raise TypeError(f"Unexpected byte_range, got {byte_range!r}")


class CachedStore(Store):
    """Read-only zarr Store: the tiers of ``cache`` in front of the store at ``url``.

    Args:
        url: local path, NFS path or fsspec URL of the origin store.
        store_id: the manifest's store id (the cache namespace, unless ``namespace``).
        cache: tier settings; ``None`` reads the origin directly.
        storage_options: passed to fsspec.
        complete: every chunk object was written (a missing one is an error).
        check_root: read the root beside every round of origin reads and raise
            :class:`zstore.StoreReplacedError` where its store id is no longer
            ``store_id`` (``open_store`` sets it for a store with a manifest).
        namespace: the cache namespace, when not ``store_id``: a store appended to
            has its last append's id in it (:func:`zstore.format.lineage.cache_namespace`),
            since copies of a store share its id, not what their appends wrote.
        appends: the ids of the appends the store had when opened; ``check_root``
            also raises where the root's do not begin with them (a store restored
            from a backup, or another copy put in its place).
    """

    supports_writes = False
    supports_deletes = False
    supports_partial_writes = False
    supports_listing = True

    def __init__(
        self,
        url: str,
        *,
        store_id: str,
        cache: CacheConfig | None = None,
        storage_options: dict[str, Any] | None = None,
        read_only: bool = True,
        complete: bool = False,
        check_root: bool = False,
        namespace: str | None = None,
        appends: Sequence[str] = (),
    ):
        super().__init__(read_only=True)
        if not read_only:
            raise ValueError(
                f"{url}: zstore's cached store is read-only; write through "
                "zarr.storage or 'zstore convert' instead"
            )
        self.url = str(url)
        self.store_id = store_id
        self.namespace = namespace or store_id
        self.appends = list(appends)
        self.cache = cache
        self.storage_options = dict(storage_options or {})
        self.complete = complete
        self.check_root = check_root
        self._metas: Any = None  # the store's ArrayMetas, read on the first missing key
        self._origin = zarr_store(self.url, self.storage_options, read_only=True)
        #: the store this was opened on (its id), checked beside every origin round
        self._check = (
            StoreCheck(self.url, store_id, self.appends) if check_root and store_id else None
        )
        #: a local store's root is read by zstore's origin (a direct read; zarr's local
        #: reads go through a thread, ~0.3 ms each)
        self._local_origin = None if is_url(self.url) else Origin(self.url, self.storage_options)
        self.tiers = (
            TieredCache(cache.resolved().for_store(self.url), self.namespace)
            if cache is not None
            else None
        )

    def __getstate__(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "store_id": self.store_id,
            "cache": self.cache,
            "storage_options": self.storage_options,
            "complete": self.complete,
            "check_root": self.check_root,
            "namespace": self.namespace,
            "appends": self.appends,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, **state)

    def __repr__(self) -> str:
        return f"CachedStore({self.url!r}, store_id={self.store_id!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, CachedStore)
            and self.url == other.url
            and self.store_id == other.store_id
            and self.namespace == other.namespace
            and self.cache == other.cache
        )

    def with_read_only(self, read_only: bool = False) -> CachedStore:
        return CachedStore(
            self.url,
            store_id=self.store_id,
            cache=self.cache,
            storage_options=self.storage_options,
            read_only=read_only,
            complete=self.complete,
            check_root=self.check_root,
            namespace=self.namespace,
            appends=self.appends,
        )

    async def _fetch(
        self, wanted: list[tuple[str, ByteRequest | None]], prototype: BufferPrototype
    ) -> list[Buffer | None]:
        """Read ``wanted`` (key, byte range) from the origin in one round, with the
        store's root where it is checked: a round that finds the store replaced or
        removed since it was opened raises :class:`StoreReplacedError` and returns none
        of its values (:mod:`zstore.read._replaced`).  A local store's root is read
        right after the values (~20 us: an overwrite rewrites the root before any
        object, so a value of the new store is always seen with its root); a remote
        store's in the same concurrent round, as the reader's rounds do.  (zarr reads a
        shard's chunks one ``get`` at a time, so a round is mostly one chunk.)"""
        check = self._check
        reads: list[Any] = [
            self._origin.get(key, prototype, WHOLE if byte_range is None else byte_range)
            for key, byte_range in wanted
        ]
        remote_check = check is not None and self._local_origin is None
        if remote_check:
            reads.append(self._origin.get(ROOT, prototype, WHOLE))
        bufs: list[Buffer | None] = list(await asyncio.gather(*reads))
        if check is not None and self._local_origin is not None:
            check.now(self._local_origin)
        elif check is not None:
            root = bufs.pop()
            check.verify(root.to_bytes() if root is not None else None)
        if self.tiers is not None:
            got = [buf for buf in bufs if buf is not None]
            self.tiers.stats.add("origin_requests", len(got))
            self.tiers.stats.add("origin_bytes", sum(len(buf) for buf in got))
        return bufs

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        return (await self.get_partial_values(prototype, [(key, byte_range)]))[0]

    def _check_missing(self, key: str) -> None:
        """Raise for a chunk object that a complete store must hold (zarr would read the
        fill value, i.e. zeros, for it); other missing keys are zarr's business."""
        if not self.complete:
            return
        from zstore.read._chunks import chunk_array, missing_error

        array = chunk_array(key)
        if not array:
            return
        if self._metas is None:
            self._metas = read_manifest(self.url, self.storage_options)[1]
        if self._metas.is_array(array):
            raise missing_error(self.url, key, "object")

    def get_sync(
        self,
        key: str,
        *,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        """Synchronous :meth:`get` (zarr's sync read path)."""
        from zarr.core.sync import sync

        return sync(self.get(key, prototype or default_buffer_prototype(), byte_range))

    async def get_partial_values(
        self,
        prototype: BufferPrototype,
        key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        """Each (key, byte range) from the tiers, the rest from the origin in one round
        (:meth:`_fetch`), put in the tiers; None for a key missing at the origin (zarr
        reads the fill value; a complete store's missing chunk object raises)."""
        await self._ensure_open()
        wanted = list(key_ranges)
        out: list[Buffer | None] = [None] * len(wanted)
        misses: list[int] = []
        for i, (key, byte_range) in enumerate(wanted):
            value = self.tiers.lookup(tier_key(key, byte_range)) if self.tiers is not None else None
            if value is None:
                misses.append(i)
            else:
                out[i] = prototype.buffer.from_bytes(value)
        if not misses:
            return out
        fetched = await self._fetch([wanted[i] for i in misses], prototype)
        for i, buf in zip(misses, fetched):
            key, byte_range = wanted[i]
            if buf is None:
                self._check_missing(key)
                continue
            if self.tiers is not None:
                self.tiers.fill(tier_key(key, byte_range), buf.to_bytes())
            out[i] = buf
        return out

    async def exists(self, key: str) -> bool:
        return await self._origin.exists(key)

    async def getsize(self, key: str) -> int:
        return await self._origin.getsize(key)

    async def set(self, key: str, value: Buffer) -> None:
        raise ValueError(_READ_ONLY)

    async def delete(self, key: str) -> None:
        raise ValueError(_READ_ONLY)

    async def clear(self) -> None:
        raise ValueError(_READ_ONLY)

    def list(self) -> AsyncIterator[str]:
        return self._origin.list()

    def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        return self._origin.list_prefix(prefix)

    def list_dir(self, prefix: str) -> AsyncIterator[str]:
        return self._origin.list_dir(prefix)


def open_store(
    url: str,
    *,
    cache: CacheConfig | bool | None = None,
    storage_options: dict[str, Any] | None = None,
) -> CachedStore:
    """Open the store at ``url`` (path or fsspec URL) read-only, with the cache tiers.

    ``zarr.open_group(zstore.open_store(url), mode="r")`` then reads through the
    node-shared cache.  ``cache=None`` uses :class:`CacheConfig` defaults and the
    ``ZSTORE_*`` environment; ``cache=False`` reads the origin directly.
    """
    url = str(url)
    config = as_cache_config(cache)
    meta = read_root(Origin(url, storage_options), url)
    manifest = meta.get("attributes", {}).get(MANIFEST_ATTR, {})
    store_id = manifest.get("store_id")
    if store_id is None and config is not None:
        warnings.warn(
            f"{url} has no zstore manifest, so it is read without the cache "
            "(a cache needs the store id to stay correct); convert it with "
            "'zstore convert'",
            stacklevel=2,
        )
        config = None
    return CachedStore(
        url,
        store_id=store_id or "",
        cache=config,
        storage_options=storage_options,
        complete=bool(manifest.get("all_chunks_written")),
        check_root=store_id is not None,
        namespace=cache_namespace(store_id or "", manifest),
        appends=append_ids(manifest),
    )
