"""Window -> chunk keys -> bytes through the tiers -> decoded arrays.  The hot path.

For each field of a window the reader computes the inner chunks it overlaps.
With a decoded RAM tier, a chunk already there is a read-only memory map of a
tmpfs file, kept mapped by this process (no syscall on a repeat hit); the
window is then one copy out of those maps.  Missing chunks are resolved to
byte ranges through the shard index, fetched together (the tiers first, then
the origin in one concurrent batch), decoded, stored decoded in RAM and
encoded on SSD.  Layouts the reader does not handle go through zarr's own
indexing on the cached store.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import numpy as np

from zstore.cache.tiers import TieredCache
from zstore.config import CacheConfig, ResolvedCache
from zstore.decode import EMPTY, decode_chunk, decode_index, fill_chunk
from zstore.errors import IntegrityError, StoreFormatError
from zstore.layout import MANIFEST_ATTR, ArrayLayout, Manifest, Span, parse_array_meta
from zstore.origin import Origin, describe, is_url
from zstore.store import CachedStore, read_root_metadata

MAX_MAPS = 8192  # decoded chunks a process keeps mapped (vm.max_map_count is ~65k)
RECHECK_EVERY = 2048  # hits between checks that mapped chunks were not evicted
MAX_INDEXES = 4096  # shard indexes (~1 KiB each) a process keeps


class WindowReader:
    """Reads windows of a zstore store.  Opens lazily, once per process; pickles small."""

    def __init__(self, url: str, *, cache: CacheConfig | None = None,
                 storage_options: dict[str, Any] | None = None, origin_fs: Any = None):
        self.url = str(url) if is_url(str(url)) else os.path.abspath(str(url))
        self.cache = cache
        self.storage_options = dict(storage_options or {})
        self.origin_fs = origin_fs
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "cache": self.cache, "storage_options": self.storage_options,
                "origin_fs": self.origin_fs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], cache=state["cache"],
                      storage_options=state["storage_options"], origin_fs=state["origin_fs"])

    def open(self) -> WindowReader:
        """Read the manifest and set up this process's handles (idempotent per process)."""
        if self._pid == os.getpid():
            return self
        meta = self._root_meta()
        self.manifest = Manifest.from_json(meta.get("attributes", {}).get(MANIFEST_ATTR),
                                           self.url)
        self._metas: dict[str, Any] = (meta.get("consolidated_metadata") or {}).get(
            "metadata", {})
        resolved: ResolvedCache | None = self.cache.resolved() if self.cache else None
        self.tiers = TieredCache(resolved, self.manifest.store_id) if resolved else None
        self.origin = Origin(self.url, self.storage_options, fs=self.origin_fs,
                             max_requests=resolved.max_requests if resolved else 16)
        self.fetch = self._fetch_mode(resolved)
        self._layouts: dict[tuple[str, str], ArrayLayout] = {}
        self._maps: OrderedDict[str, tuple[np.ndarray, str, int]] = OrderedDict()
        self._indexes: OrderedDict[str, np.ndarray] = OrderedDict()
        self._hits_since_check = 0
        self._group: Any = None
        self._pid = os.getpid()
        return self

    def _root_meta(self) -> dict[str, Any]:
        if self.origin_fs is None:
            return read_root_metadata(self.url, self.storage_options)
        import json

        return json.loads(Origin(self.url, fs=self.origin_fs).read("zarr.json"))

    def _fetch_mode(self, resolved: ResolvedCache | None) -> str:
        mode = resolved.fetch if resolved else "range"
        if mode != "auto":
            return mode
        remote = is_url(self.url) or self.origin_fs is not None
        fits = resolved is not None and resolved.ssd_dir is not None and \
            resolved.ssd_bytes >= int(self.manifest.extra.get("store_bytes", 2**62))
        return "shard" if remote and fits else "range"

    def layout(self, item: str, name: str) -> ArrayLayout:
        """The geometry of ``item/name`` (from the consolidated metadata)."""
        self.open()
        found = self._layouts.get((item, name))
        if found is None:
            path = f"{item}/{name}"
            meta = self._metas.get(path)
            if meta is None:
                import json

                try:
                    meta = json.loads(self._get(f"{path}/zarr.json", lambda: self.origin.read(
                        f"{path}/zarr.json")))
                except FileNotFoundError:
                    raise StoreFormatError(f"{self.url}: item '{item}' has no array '{name}'; "
                                           "check the field names") from None
            found = parse_array_meta(path, meta, self.manifest.arrays[name].time_axis
                                     if name in self.manifest.arrays else None)
            self._layouts[(item, name)] = found
        return found

    def _get(self, key: str, fetch: Any, *, ram: bool = True) -> bytes:
        if self.tiers is None:
            return fetch()
        return self.tiers.get(key, fetch, ram=ram)

    def read(self, item: str, spans: dict[str, Span | None]) -> dict[str, np.ndarray]:
        """Read ``spans`` (per field; None = the whole array) of ``item``."""
        self.open()
        out: dict[str, np.ndarray] = {}
        plan: list[tuple[str, ArrayLayout, Span]] = []
        need: list[tuple[ArrayLayout, int]] = []
        chunks: dict[tuple[str, int], np.ndarray] = {}
        for name, span in spans.items():
            layout = self.layout(item, name)
            if span is None and layout.fast:
                span = Span(0, layout.length)
            if span is None or not layout.fast or layout.length == 0:
                out[name] = self._read_with_zarr(layout, span)
                continue
            plan.append((name, layout, span))
            for k in layout.chunks_for(span.start, span.stop):
                arr = self._mapped(layout, k)
                if arr is None:
                    need.append((layout, k))
                else:
                    chunks[(layout.path, k)] = arr
        if need:
            for (layout, k), arr in zip(need, self._load_once(need)):
                chunks[(layout.path, k)] = arr
        for name, layout, span in plan:
            out[name] = _assemble(layout, span, chunks)
        return out

    def _mapped(self, layout: ArrayLayout, k: int, again: bool = False) -> np.ndarray | None:
        key = f"{layout.path}#d{k}"
        entry = self._maps.get(key)
        tiers = self.tiers
        if entry is not None:
            tiers.stats.add("ram_hits")  # type: ignore[union-attr]
            self._hits_since_check += 1
            if self._hits_since_check >= RECHECK_EVERY:
                self._drop_evicted()
            return entry[0]
        if tiers is None or not tiers.decoded:
            return None
        got = tiers.ram.get_mapped(tiers.key(key), count_miss=not again)  # type: ignore
        if got is None:
            return None
        payload, path, ino = got
        try:
            arr = np.frombuffer(payload, dtype=layout.dtype).reshape(layout.chunk_shape)
        except ValueError:
            return None
        self._maps[key] = (arr, path, ino)
        if len(self._maps) > MAX_MAPS:
            self._maps.popitem(last=False)
        return arr

    def _drop_evicted(self) -> None:
        """Unmap chunks another process evicted, so their tmpfs pages are freed."""
        self._hits_since_check = 0
        for key, (_, path, ino) in list(self._maps.items()):
            try:
                alive = os.stat(path).st_ino == ino
            except OSError:
                alive = False
            if not alive:
                del self._maps[key]

    def _index(self, layouts: list[tuple[ArrayLayout, int]]) -> dict[str, np.ndarray]:
        """Shard indexes of the given (layout, shard) pairs, fetched together."""
        found: dict[str, np.ndarray] = {}
        todo: dict[str, tuple[ArrayLayout, str]] = {}
        for layout, shard in layouts:
            obj = layout.object_key(shard)
            if obj in self._indexes:
                found[obj] = self._indexes[obj]
            elif obj not in todo:
                todo[obj] = (layout, f"{obj}#s{layout.index_bytes}")
        if todo:
            keys = [ckey for _, ckey in todo.values()]
            requests = [(obj, -layout.index_bytes, None) for obj, (layout, _) in todo.items()]
            values = self._fetch_many(keys, requests, ram=True,
                                      layouts={obj: lay for obj, (lay, _) in todo.items()})
            for (obj, (layout, ckey)), data in zip(todo.items(), values):
                if data is None:
                    index = np.full((layout.chunks_per_shard, 2), EMPTY, dtype=np.uint64)
                else:
                    index = decode_index(layout, data, f"{self.url}: {obj} (shard index)")
                found[obj] = self._indexes[obj] = index
                if len(self._indexes) > MAX_INDEXES:
                    self._indexes.popitem(last=False)
        return found

    def _fetch_many(self, keys: list[str], requests: list[tuple[str, int | None, int | None]],
                    *, ram: bool, layouts: dict[str, ArrayLayout] | None = None
                    ) -> list[bytes | None]:
        """Values for cache ``keys`` from the tiers, else the origin (one concurrent batch).

        None stands for an object missing at the origin (a chunk never written).
        """
        by_key = dict(zip(keys, requests))

        def fetch(miss: list[str]) -> list[bytes | None]:
            return self._from_origin([by_key[k] for k in miss], layouts or {})

        if self.tiers is None:
            return fetch(keys)
        return self.tiers.get_many(keys, fetch, ram=ram)

    def _from_origin(self, requests: list[tuple[str, int | None, int | None]],
                     layouts: dict[str, ArrayLayout]) -> list[bytes | None]:
        if self.fetch != "shard":
            return self._read_ranges(requests)
        objects = sorted({r[0] for r in requests})
        whole = dict(zip(objects, self._read_ranges([(o, None, None) for o in objects])))
        for obj, data in whole.items():
            if data is not None and obj in layouts:
                self._fill_shard(obj, layouts[obj], data, requests)
        return [None if whole[obj] is None else _slice(whole[obj], start, stop)
                for obj, start, stop in requests]

    def _fill_shard(self, obj: str, layout: ArrayLayout, data: bytes,
                    requested: list[tuple[str, int | None, int | None]]) -> None:
        """Put every chunk of a whole shard into the SSD tier (``fetch="shard"``)."""
        if self.tiers is None or len(data) < layout.index_bytes:
            return
        index = decode_index(layout, data[-layout.index_bytes:], f"{self.url}: {obj}")
        skip = {(r[1], r[2]) for r in requested if r[0] == obj}
        ram = not self.tiers.decoded
        for offset, nbytes in index:
            if offset == EMPTY or (int(offset), int(offset + nbytes)) in skip:
                continue
            start, stop = int(offset), int(offset + nbytes)
            self.tiers.fill(f"{obj}#r{start}-{stop}", data[start:stop], ram=ram)

    def _read_ranges(self, requests: list[tuple[str, int | None, int | None]]
                     ) -> list[bytes | None]:
        try:
            datas: list[bytes | None] = list(self.origin.read_many(requests))
        except FileNotFoundError:  # some object is missing: find which, one by one
            datas = []
            for r in requests:
                try:
                    datas.append(self.origin.read(*r))
                except FileNotFoundError:
                    datas.append(None)
        if self.tiers is not None:
            self.tiers.stats.add("origin_requests", len(requests))
            self.tiers.stats.add("origin_bytes", sum(len(d) for d in datas if d is not None))
        return datas

    def _load_once(self, need: list[tuple[ArrayLayout, int]]) -> list[np.ndarray]:
        """:meth:`_load` under node-wide locks, so each chunk is decoded into RAM once."""
        tiers = self.tiers
        if tiers is None or not tiers.decoded or tiers.decode_locks is None:
            return self._load(need)
        with tiers.decode_locks.hold(f"{layout.path}#d{k}" for layout, k in need):
            found = [self._mapped(layout, k, again=True) for layout, k in need]
            todo = [i for i, arr in enumerate(found) if arr is None]
            for i, arr in zip(todo, self._load([need[i] for i in todo]) if todo else []):
                found[i] = arr
        return found  # type: ignore[return-value]

    def _load(self, need: list[tuple[ArrayLayout, int]]) -> list[np.ndarray]:
        """Fetch, decode and cache the chunks in ``need``."""
        indexes = self._index([(layout, k // layout.chunks_per_shard)
                               for layout, k in need if layout.sharded])
        keys, requests, slots = [], [], []
        result: list[np.ndarray | None] = [None] * len(need)
        for i, (layout, k) in enumerate(need):
            obj = layout.object_key(k // layout.chunks_per_shard)
            if not layout.sharded:  # one object per chunk
                keys.append(obj)
                requests.append((obj, None, None))
                slots.append(i)
                continue
            offset, nbytes = indexes[obj][k % layout.chunks_per_shard]
            if offset == EMPTY:
                result[i] = fill_chunk(layout)
                continue
            start, stop = int(offset), int(offset + nbytes)
            keys.append(f"{obj}#r{start}-{stop}")
            requests.append((obj, start, stop))
            slots.append(i)
        encoded_in_ram = self.tiers is not None and not self.tiers.decoded
        layouts = {layout.object_key(k // layout.chunks_per_shard): layout
                   for layout, k in need if layout.sharded}
        values = self._fetch_many(keys, requests, ram=encoded_in_ram,
                                  layouts=layouts) if keys else []
        for i, key, request, data in zip(slots, keys, requests, values):
            layout, k = need[i]
            where = f"{self.url}: {describe(*request)}"
            if data is None:  # an unsharded chunk the store never wrote
                arr = fill_chunk(layout)
            else:
                try:
                    arr = decode_chunk(layout, data, where)
                except IntegrityError:  # refetch once from the origin, past the tiers
                    arr = decode_chunk(layout, self.origin.read(*request), where)
            if self.tiers is not None and self.tiers.decoded:
                self.tiers.ram.put(self.tiers.key(f"{layout.path}#d{k}"), arr)  # type: ignore
            result[i] = arr
        return result  # type: ignore[return-value]

    def _read_with_zarr(self, layout: ArrayLayout, span: Span | None) -> np.ndarray:
        """Fallback: zarr's own indexing on the cached store."""
        if self._group is None:
            import zarr

            store = CachedStore(self.url, store_id=self.manifest.store_id, cache=self.cache,
                                storage_options=self.storage_options)
            self._group = zarr.open_group(store, mode="r")
        arr = self._group[layout.path]
        if span is None:
            return np.asarray(arr[...])
        index = [slice(None)] * len(layout.shape)
        index[layout.time_axis] = slice(span.start, span.stop)
        data = np.asarray(arr[tuple(index)])
        if span.pad:
            widths = [(0, 0)] * data.ndim
            widths[layout.time_axis] = (0, span.pad)
            data = np.pad(data, widths)
        return data


def _slice(data: bytes, start: int | None, stop: int | None) -> bytes:
    if start is not None and start < 0:
        return data[start:]
    return data[start or 0:stop]


def _assemble(layout: ArrayLayout, span: Span, chunks: dict[tuple[str, int], np.ndarray]
              ) -> np.ndarray:
    axis, c = layout.time_axis, layout.chunk
    shape = list(layout.shape)
    shape[axis] = span.stop - span.start + span.pad
    out = np.empty(shape, dtype=layout.dtype)
    dst = [slice(None)] * len(shape)
    src = [slice(None)] * len(shape)
    for k in layout.chunks_for(span.start, span.stop):
        lo, hi = max(span.start, k * c), min(span.stop, (k + 1) * c)
        dst[axis] = slice(lo - span.start, hi - span.start)
        src[axis] = slice(lo - k * c, hi - k * c)
        out[tuple(dst)] = chunks[(layout.path, k)][tuple(src)]
    if span.pad:
        dst[axis] = slice(span.stop - span.start, None)
        out[tuple(dst)] = 0
    return out
