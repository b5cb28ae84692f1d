"""Window -> chunk keys -> bytes through the tiers -> decoded arrays.  The hot path.

With a decoded RAM tier (the default) the unit in RAM is a decoded shard: one
tmpfs file per array per shard (up to 64 s), memory-mapped read-only and kept
mapped by each process, so a warm window is one dict lookup and one copy per
field.  A shard missing from RAM is built from its chunks (SSD tier, else the
origin in one concurrent batch), decoded once for the whole node under a lock,
and published to the RAM tier.  Without a decoded RAM tier the reader fetches
and decodes only the chunks the window overlaps (see :mod:`zstore.fetch`).
Layouts the reader does not handle go through zarr's own indexing.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from zstore.cache.choice import FormatChoice
from zstore.cache.choice import choose as choose_format
from zstore.cache.choice import record as record_format
from zstore.cache.tiers import TieredCache, node_dir
from zstore.cache.value import Checked
from zstore.config import CacheConfig, ResolvedCache
from zstore.errors import IntegrityError, StoreFormatError
from zstore.fetch import ChunkSource
from zstore.layout import ArrayLayout, Span, parse_array_meta
from zstore.origin import Origin, is_url
from zstore.sizing import field_sizes
from zstore.store import CachedStore, read_manifest

MAX_MAPS = 4096  # decoded shards a process keeps mapped (vm.max_map_count is ~65k)
SCRATCH_MMAP = 2**20  # decoded shards from this size up are built outside the heap
UNMAP_EVERY = 0.2  # seconds between an idle process's checks for evicted shards
PASSES = 8  # admission counts are halved every PASSES x (values of the store) accesses
Pieces = dict[tuple[str, int], tuple[int, np.ndarray]]  # (path, n) -> (time offset, array)


class WindowReader:
    """Reads windows of a zstore store.  Opens lazily, once per process; pickles small."""

    def __init__(self, url: str, *, cache: CacheConfig | None = None,
                 storage_options: dict[str, Any] | None = None, origin_fs: Any = None,
                 fields: Sequence[str] | None = None):
        self.url = str(url) if is_url(str(url)) else os.path.abspath(str(url))
        self.cache = cache
        self.storage_options = dict(storage_options or {})
        self.origin_fs = origin_fs
        self.fields = list(fields) if fields is not None else None  # sizes the RAM format
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "cache": self.cache, "storage_options": self.storage_options,
                "origin_fs": self.origin_fs, "fields": self.fields}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], cache=state["cache"],
                      storage_options=state["storage_options"], origin_fs=state["origin_fs"],
                      fields=state.get("fields"))

    def open(self) -> WindowReader:
        """Read the manifest and set up this process's handles (idempotent per process)."""
        if self._pid == os.getpid():
            return self
        self.manifest, self._metas = read_manifest(self.url, self.storage_options,
                                                   self.origin_fs)
        resolved: ResolvedCache | None = self.cache.resolved() if self.cache else None
        self.tiers = TieredCache(resolved, self.manifest.store_id) if resolved else None
        self.format_choice = self._choose_format(resolved) if self.tiers else None
        self.origin = Origin(self.url, self.storage_options, fs=self.origin_fs,
                             max_requests=resolved.max_requests if resolved else 16)
        self.fetch = self._fetch_mode(resolved)
        self.source = ChunkSource(self.url, self.origin, self.tiers, self.fetch,
                                  complete=self.manifest.all_chunks_written)
        self._decoded = self.tiers is not None and self.tiers.decoded
        self._layouts: dict[tuple[str, str], ArrayLayout] = {}
        self._maps: OrderedDict[tuple[str, int], tuple[np.ndarray, Checked, str, int]] = \
            OrderedDict()
        self._evicted_seen = self.tiers.ram.evictions.head() if self._decoded else 0  # type: ignore
        self._lock = threading.Lock()
        if self._decoded:
            _start_unmapper(self)
        self._fits: dict[str, bool] = {}
        self._group: Any = None
        self._pid = os.getpid()
        return self

    def _choose_format(self, resolved: ResolvedCache) -> FormatChoice:
        """Settle ``ram_format`` for this store and size the tiers' admission periods."""
        tiers: TieredCache = self.tiers  # type: ignore[assignment]
        sizes = field_sizes(self.manifest, self._metas, self.fields)
        choice = choose_format(resolved, sizes.decoded_bytes, sizes.stored_bytes)
        tiers.ram_format = choice.format
        # Halve the access counts every few passes over the values (see cache.admission).
        if tiers.ram is not None:
            tiers.ram.set_period(PASSES * (sizes.shards if choice.format == "decoded"
                                           else sizes.chunks))
        if tiers.ssd is not None:
            tiers.ssd.set_period(PASSES * sizes.chunks)
        record_format(node_dir(resolved, "formats"), self.manifest.store_id, choice)
        return choice

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
                try:
                    key = f"{path}/zarr.json"
                    raw = self.tiers.get(key, lambda: self.origin.read(key)) \
                        if self.tiers is not None else self.origin.read(key)
                    meta = json.loads(raw)
                except FileNotFoundError:
                    raise StoreFormatError(f"{self.url}: item '{item}' has no array '{name}'; "
                                           "check the field names") from None
            found = parse_array_meta(path, meta, self.manifest.arrays[name].time_axis
                                     if name in self.manifest.arrays else None)
            self._layouts[(item, name)] = found
        return found

    def read(self, item: str, spans: dict[str, Span | None]) -> dict[str, np.ndarray]:
        """Read ``spans`` (per field; None = the whole array) of ``item``."""
        self.open()
        with self._lock:  # the unmapping thread edits the maps between reads
            return self._read(item, spans)

    def _read(self, item: str, spans: dict[str, Span | None]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        plan: list[tuple[str, ArrayLayout, Span]] = []
        for name, span in spans.items():
            layout = self.layout(item, name)
            if span is not None and not 0 <= span.start <= span.stop <= layout.length:
                raise ValueError(
                    f"{self.url}: window [{span.start}, {span.stop}) of '{item}/{name}' lies "
                    f"outside the array (length {layout.length} along time); a window must "
                    "end within every array it reads")
            if span is None and layout.fast:
                span = Span(0, layout.length)
            if span is None or not layout.fast or layout.length == 0:
                out[name] = self._read_with_zarr(layout, span)
            else:
                plan.append((name, layout, span))
        if plan:
            # Decoded shards for the fields whose shards fit the RAM tier; the others
            # (or all, without a decoded RAM tier) read just the window's chunks.
            whole = [p for p in plan if self._decoded and self._shard_fits(p[1])]
            pieces = self._shards(whole) if whole else {}
            if len(whole) < len(plan):
                pieces.update(self._chunks([p for p in plan if p not in whole]))
            for name, layout, span in plan:
                out[name] = _assemble(layout, span, pieces)
        return out

    def _shard_fits(self, layout: ArrayLayout) -> bool:
        fits = self._fits.get(layout.path)
        if fits is None:
            nbytes = int(np.prod(_shard_shape(layout, 0))) * layout.dtype.itemsize
            fits = self._fits[layout.path] = self.tiers.ram.fits(  # type: ignore[union-attr]
                nbytes, blocked=True)
        return fits

    def _chunks(self, plan: list[tuple[str, ArrayLayout, Span]]) -> Pieces:
        need = [(layout, k) for _, layout, span in plan
                for k in layout.chunks_for(span.start, span.stop)]
        # With decoded shards in RAM, encoded chunks stay out of it (the SSD tier has them).
        arrays = self.source.chunks(need, ram=self.tiers is not None and not self._decoded)
        return {(layout.path, -1 - k): (k * layout.chunk, arr)  # keys apart from shards'
                for (layout, k), arr in zip(need, arrays)}

    def _shards(self, plan: list[tuple[str, ArrayLayout, Span]]) -> Pieces:
        """Mapped decoded shards of the window; a missing shard is built when the RAM
        tier admits it, else the window's chunks in it are read and decoded instead."""
        pieces: Pieces = {}
        missing: list[tuple[ArrayLayout, int]] = []
        direct: list[tuple[str, ArrayLayout, Span]] = []
        ram = self.tiers.ram  # type: ignore[union-attr]
        for name, layout, span in plan:
            for s in range(span.start // layout.shard, (span.stop - 1) // layout.shard + 1):
                arr = self._mapped(layout, s)
                if arr is not None and not self._checked(layout, s, arr, span):
                    arr = None
                if arr is not None:
                    pieces[(layout.path, s)] = (s * layout.shard, arr)
                elif ram.admits(self.tiers.key(_decoded_key(layout, s)),  # type: ignore
                                _shard_nbytes(layout, s), blocked=True):
                    missing.append((layout, s))
                else:  # the part of the window in this shard, from its chunks
                    lo, hi = max(span.start, s * layout.shard), min(span.stop,
                                                                  (s + 1) * layout.shard)
                    direct.append((name, layout, Span(lo, hi)))
        if missing:
            for (layout, s), arr in zip(missing, self._build(missing)):
                pieces[(layout.path, s)] = (s * layout.shard, arr)
        if direct:
            pieces.update(self._chunks(direct))
        return pieces

    def _checked(self, layout: ArrayLayout, s: int, arr: np.ndarray, span: Span) -> bool:
        """Check the blocks of a mapped shard this span reads (once per process)."""
        checked = self._maps[(layout.path, s)][1]
        if checked.complete:
            return True
        offset, axis, isz = s * layout.shard, layout.time_axis, arr.itemsize
        lo = max(span.start, offset) - offset
        hi = min(span.stop, offset + arr.shape[axis]) - offset
        if axis == arr.ndim - 1:
            t = arr.shape[-1]
            good = all(checked.verify((r * t + lo) * isz, (r * t + hi) * isz)
                       for r in range(arr.size // t))
        elif axis == 0:
            row = arr.nbytes // arr.shape[0]
            good = checked.verify(lo * row, hi * row)
        else:
            good = checked.verify(0, arr.nbytes)
        if not good:  # the caller rebuilds the shard
            self._discard(layout, s)
        return good

    def _discard(self, layout: ArrayLayout, s: int) -> None:
        """Unmap a shard found corrupt and drop it from the RAM tier."""
        del self._maps[(layout.path, s)]
        self.tiers.ram.drop(self.tiers.key(_decoded_key(layout, s)))  # type: ignore[union-attr]

    def _mapped(self, layout: ArrayLayout, s: int, again: bool = False) -> np.ndarray | None:
        entry = self._maps.get((layout.path, s))
        tiers: TieredCache = self.tiers  # type: ignore[assignment]
        if entry is not None:
            if tiers.ram.evictions.head() != self._evicted_seen:  # type: ignore[union-attr]
                self._drop_evicted()
                return self._mapped(layout, s, again)
            tiers.stats.add("ram_hits")
            tiers.ram.touch(tiers.key(_decoded_key(layout, s)))  # type: ignore[union-attr]
            return entry[0]
        got = tiers.ram.get_mapped(tiers.key(_decoded_key(layout, s)),  # type: ignore
                                   count_miss=not again)
        if got is None:
            return None
        checked, path, ino = got
        try:
            arr = np.frombuffer(checked.payload, dtype=layout.dtype).reshape(
                _shard_shape(layout, s))
        except ValueError:
            return None
        self._maps[(layout.path, s)] = (arr, checked, path, ino)
        if len(self._maps) > MAX_MAPS:
            self._maps.popitem(last=False)
        return arr

    def _build(self, missing: list[tuple[ArrayLayout, int]]) -> list[np.ndarray]:
        """Decode whole shards into the RAM tier, once for the node (under its lock)."""
        tiers: TieredCache = self.tiers  # type: ignore[assignment]
        keys = [_decoded_key(layout, s) for layout, s in missing]
        with tiers.decode_locks.hold(keys):  # type: ignore[union-attr]
            found = [self._mapped(layout, s, again=True) for layout, s in missing]
            for i, (layout, s) in enumerate(missing):  # built meanwhile by another process:
                entry = self._maps.get((layout.path, s))  # rare, so check it whole
                if found[i] is not None and entry and not entry[1].verify(
                        0, len(entry[1].payload)):
                    self._discard(layout, s)
                    found[i] = None
            todo = [i for i, arr in enumerate(found) if arr is None]
            need = []
            for i in todo:
                layout, s = missing[i]
                last = min((s + 1) * layout.chunks_per_shard, -(-layout.length // layout.chunk))
                need += [(layout, k) for k in range(s * layout.chunks_per_shard, last)]
            chunks = self.source.iter_chunks(need, ram=False) if need else iter(())
            for i in todo:
                layout, s = missing[i]
                shard = _scratch(_shard_shape(layout, s), layout.dtype)
                for k in range(-(-shard.shape[layout.time_axis] // layout.chunk)):
                    _copy_time(shard, k * layout.chunk, next(chunks), layout.time_axis)
                tiers.ram.put(tiers.key(keys[i]), shard, blocked=True)  # type: ignore
                found[i] = shard
            del chunks  # the fetched bytes go with it, before the heap is trimmed
        release_free_memory()
        self._drop_evicted()  # including what this build evicted
        return found  # type: ignore[return-value]

    def _drop_evicted(self) -> None:
        """Unmap shards evicted by any process, so their tmpfs pages are freed."""
        log = self.tiers.ram.evictions  # type: ignore[union-attr]
        self._evicted_seen, inodes = log.since(self._evicted_seen)
        if inodes is None:  # more evictions than the log holds: check every map
            gone = [k for k, (_, _, path, ino) in self._maps.items() if not _alive(path, ino)]
        else:
            evicted = set(inodes)
            gone = [k for k, entry in self._maps.items() if entry[3] in evicted]
        for key in gone:
            del self._maps[key]

    def _read_with_zarr(self, layout: ArrayLayout, span: Span | None) -> np.ndarray:
        """Fallback: zarr's own indexing on the cached store."""
        if self._group is None:
            import zarr

            store = CachedStore(self.url, store_id=self.manifest.store_id, cache=self.cache,
                                storage_options=self.storage_options,
                                complete=self.manifest.all_chunks_written)
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


def _start_unmapper(reader: WindowReader) -> None:
    """A daemon thread that drops the maps of shards other processes evicted, so an idle
    process (a worker between epochs) does not keep their tmpfs pages alive."""
    ref = weakref.ref(reader)
    pid = os.getpid()

    def loop() -> None:
        while True:
            time.sleep(UNMAP_EVERY)
            current = ref()
            if current is None or current._pid != pid:
                return
            log = current.tiers.ram.evictions  # type: ignore[union-attr]
            if log.head() != current._evicted_seen:
                with current._lock:
                    current._drop_evicted()
            del current

    threading.Thread(target=loop, name="zstore-unmap", daemon=True).start()


def _alive(path: str, ino: int) -> bool:
    try:
        return os.stat(path).st_ino == ino
    except OSError:
        return False


def release_free_memory() -> None:
    """Hand freed heap back to the OS (glibc keeps it after large temporaries such as the
    decoded shards, and per-process memory is what the shared RAM tier exists to save)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def _scratch(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An array for a decoded shard; a large one gets its own anonymous mapping, returned
    to the OS as soon as the array is freed.

    A decoded shard (tens of MB) lives only until it is in the RAM tier and the window
    is copied out.  Taken from malloc, freeing it would raise glibc's dynamic mmap
    threshold to its size; from then on shard-sized temporaries would come from the
    heap, which keeps freed pages, and each process would hold tens of MB that the
    shared tier exists to save (measured, see docs/benchmarks.md).
    """
    count = int(np.prod(shape))
    if count * dtype.itemsize < SCRATCH_MMAP:
        return np.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, count * dtype.itemsize)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


def _decoded_key(layout: ArrayLayout, s: int) -> str:
    """The RAM-tier key (before the store's namespace) of shard ``s`` decoded."""
    return f"{layout.object_key(s)}#D"


def _shard_nbytes(layout: ArrayLayout, s: int) -> int:
    return int(np.prod(_shard_shape(layout, s))) * layout.dtype.itemsize


def _shard_shape(layout: ArrayLayout, s: int) -> tuple[int, ...]:
    shape = list(layout.shape)
    shape[layout.time_axis] = min(layout.shard, layout.length - s * layout.shard)
    return tuple(shape)


def _copy_time(dst: np.ndarray, offset: int, src: np.ndarray, axis: int) -> None:
    """Copy ``src`` into ``dst`` at ``offset`` along ``axis``, clipped to ``dst``."""
    n = min(src.shape[axis], dst.shape[axis] - offset)
    d = [slice(None)] * dst.ndim
    s = [slice(None)] * dst.ndim
    d[axis], s[axis] = slice(offset, offset + n), slice(0, n)
    dst[tuple(d)] = src[tuple(s)]


def _assemble(layout: ArrayLayout, span: Span, pieces: Pieces) -> np.ndarray:
    """One copy of ``span`` out of the pieces (chunks or shards) that cover it."""
    axis = layout.time_axis
    shape = list(layout.shape)
    shape[axis] = span.stop - span.start + span.pad
    out = np.empty(shape, dtype=layout.dtype)
    dst = [slice(None)] * len(shape)
    src = [slice(None)] * len(shape)
    covered = 0
    for (path, _), (offset, arr) in pieces.items():
        if path != layout.path:
            continue
        lo = max(span.start, offset)
        hi = min(span.stop, offset + arr.shape[axis])
        if lo >= hi:
            continue
        dst[axis] = slice(lo - span.start, hi - span.start)
        src[axis] = slice(lo - offset, hi - offset)
        out[tuple(dst)] = arr[tuple(src)]
        covered += hi - lo
    if covered != span.stop - span.start:  # never hand out np.empty's leftover memory
        raise IntegrityError(f"'{layout.path}': the pieces read cover {covered} of the "
                             f"{span.stop - span.start} samples of window [{span.start}, "
                             f"{span.stop}); this is a bug in zstore, please report it")
    if span.pad:
        dst[axis] = slice(span.stop - span.start, None)
        out[tuple(dst)] = 0
    return out
