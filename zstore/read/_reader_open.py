"""Opening a :class:`zstore.read.reader.WindowReader` in a process: the manifest, the
node's tiers and the RAM form they keep, the origin, the chunk source and the work
behind the reads; and what a reader pickles to (a few hundred bytes, reopened lazily
in each process it reaches)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any, Self

import numpy as np

from zstore.cache import (
    CacheConfig,
    FirstReads,
    FormatChoice,
    ResolvedCache,
    TieredCache,
    make_dir,
    open_file,
)
from zstore.cache import choose as choose_format
from zstore.cache import record as record_format
from zstore.format import (
    VERIFIED,
    ArrayLayout,
    Sizes,
    append_ids,
    field_sizes,
    lineage_of,
    read_manifest,
    verified_tables,
)
from zstore.origin import Origin
from zstore.read._builds import MAX_WRITE_BYTES, BehindBuilds, FirstReadHold
from zstore.read._chunk_shards import ChunkShards
from zstore.read._chunks import ChunkSource
from zstore.read._fetch_mode import whole_shards
from zstore.read._fill_process import FillProcess
from zstore.read._fill_process import wanted as fills_in_process
from zstore.read._maps import MappedValues
from zstore.read._ram_shards import DecodedShards, EncodedShards, ShardForm
from zstore.read._reader_meta import ItemPlaces
from zstore.read._records import BatchRecords
from zstore.read._replaced import StoreCheck
from zstore.read._shard_pieces import drop_reused_scratch
from zstore.urls import is_url, local_path

#: the reader's RAM-tier form for each ``ram_format``
FORMS: dict[str, type[ShardForm] | type[ChunkShards]] = {
    "chunks": ChunkShards,
    "decoded": DecodedShards,
    "encoded": EncodedShards,
}
PASSES = 8  # admission counts are halved every PASSES x (values of the store) accesses


def admission_periods(sizes: Sizes, ram_format: str, fetch: str) -> tuple[int, int]:
    """Accesses between halvings of the RAM and the SSD tier's admission counts: PASSES
    x the values each tier holds of the store, and counts an access each time a read
    uses one.  The RAM tier's values are shards (``chunks``, ``decoded``) or chunks
    (``encoded``); the SSD tier's are shard objects where the reads keep them in slots
    or whole (``slots``, ``shard``), else chunks.  (Sized by chunks under ``slots`` and
    ``shard``, counts of per-shard values lasted ~64x the passes meant.)"""
    ram = sizes.shards if ram_format in ("chunks", "decoded") else sizes.chunks
    ssd = sizes.shards if fetch in ("slots", "shard") else sizes.chunks
    return PASSES * ram, PASSES * ssd


class ReaderSetup(ItemPlaces):
    """The part of :class:`zstore.read.reader.WindowReader` that opens it in a process
    (once per process: fork and spawn safe) and pickles it."""

    def __init__(
        self,
        url: str,
        *,
        cache: CacheConfig | None = None,
        storage_options: dict[str, Any] | None = None,
        origin_fs: Any = None,
        fields: Sequence[str] | None = None,
    ):
        self.url = str(url) if is_url(str(url)) else os.path.abspath(local_path(str(url)))
        self.cache = cache
        self.storage_options = dict(storage_options or {})
        self.origin_fs = origin_fs
        self.fields = list(fields) if fields is not None else None  # sizes the RAM format
        self._pid = -1
        #: The store's root header as this reader first read it (format 2): a process
        #: this reader is pickled to sees the same items, even after an append.
        self._header: dict[str, Any] | None = None
        #: The node directory this process keeps its copy of the item table in (None:
        #: no cache tier, the table is in the process).
        self._tables_dir: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "cache": self.cache,
            "storage_options": self.storage_options,
            "origin_fs": self.origin_fs,
            "fields": self.fields,
            "header": self._header,
            "tables": verified_tables(self._header.get("table"), self._tables_dir)
            if self._header and self._tables_dir
            else set(),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(
            self,
            state["url"],
            cache=state["cache"],
            storage_options=state["storage_options"],
            origin_fs=state["origin_fs"],
            fields=state.get("fields"),
        )
        self._header = state.get("header")
        VERIFIED.update(state.get("tables", ()))

    def open(self) -> Self:
        """Read the manifest and set up this process's handles (idempotent per process)."""
        if self._pid == os.getpid():
            return self
        resolved: ResolvedCache | None = (
            self.cache.resolved().for_store(self.url, origin_fs=self.origin_fs)
            if self.cache
            else None
        )
        self.tiers: TieredCache | None = None

        def tables(store_id: str) -> str | None:  # item tables: one copy per node
            self.tiers = TieredCache(resolved, store_id) if resolved else None
            where = self.tiers.node_dir("tables") if self.tiers else None
            # made with the tier's ownership and mode, or not used
            self._tables_dir = where if where is not None and make_dir(where) is None else None
            return self._tables_dir

        self.manifest, self._metas = read_manifest(
            self.url, self.storage_options, self.origin_fs, tables, self._header, open_file
        )
        if self.manifest.shapes is not None:  # format 2: workers keep this view
            self._header = self.manifest.header()
        if resolved and self.tiers is None:
            self.tiers = TieredCache(resolved, self.manifest.store_id)
        if self.tiers is not None:  # what each append wrote is keyed apart
            self.tiers.lineage = lineage_of(self.manifest)
        self.origin = Origin(
            self.url,
            self.storage_options,
            fs=self.origin_fs,
            max_requests=resolved.max_requests if resolved else 16,
        )
        #: The node's SSD tier can hold the whole store (as the manifest sizes it).
        self.ssd_holds_store = (
            resolved is not None
            and resolved.ssd_dir is not None
            and resolved.ssd_bytes >= int(self.manifest.extra.get("store_bytes", 2**62))
        )
        self.fetch = self._fetch_mode(resolved)
        self.format_choice = self._choose_format(resolved) if self.tiers and resolved else None
        #: this process's work behind the reads: RAM fills, and whole-shard SSD writes;
        #: both held until its first read is served (see ``start_builds``), and
        #: HOLD_AT_MOST seconds after it at the latest
        self.behind = BehindBuilds(on_idle=drop_reused_scratch, held=True)
        self.writes = BehindBuilds("zstore-ssd-write", max_bytes=MAX_WRITE_BYTES, held=True)
        starting = self.tiers.node_dir("starting") if self.tiers is not None else None
        self.hold = FirstReadHold([self.behind, self.writes], FirstReads(starting))
        self.source = ChunkSource(
            self.url,
            self.origin,
            self.tiers,
            self.fetch,
            complete=self.manifest.all_chunks_written,
            behind=self.writes,
            check=(
                StoreCheck(self.url, self.manifest.store_id, append_ids(self.manifest.extra))
                if self.manifest.store_id
                else None
            ),
        )
        self._layouts: dict[tuple[str, str], ArrayLayout] = {}
        #: packed items' batch records: their attributes and arrays stored whole
        self.records = BatchRecords(self.url, self.manifest, self._stored_bytes)
        self.values: MappedValues | None = None
        self.form: ShardForm | ChunkShards | None = None
        if self.tiers is not None and self.tiers.ram is not None:
            self.values = MappedValues(self.tiers.ram)
            kind = FORMS[self.tiers.ram_format]
            self.form = kind(self.url, self.tiers, self.source, self.values, self.behind)
        #: where this process's fills behind the reads run, if not in its thread
        self.fill_process: FillProcess | None = None
        if isinstance(self.form, ShardForm):
            self.form.first_reads = self.hold
            if resolved and fills_in_process(
                resolved.fills, packed=self.manifest.placement is not None
            ):
                tiers = self.tiers
                assert tiers is not None
                self.fill_process = self.form.fill_process = FillProcess(
                    self, resolved.fills, tiers.live_processes
                )
                self.hold.builds.append(self.fill_process)  # type: ignore[arg-type]
        self._lock = self.values.lock if self.values is not None else threading.Lock()
        self._group: Any = None
        #: small arrays stored whole that zarr reads (scalars: ~1 ms each), by path
        self._small: dict[str, np.ndarray] = {}
        self._pid = os.getpid()
        return self

    def _choose_format(self, resolved: ResolvedCache) -> FormatChoice:
        """Settle ``ram_format`` for this store and size the tiers' admission periods."""
        tiers: TieredCache = self.tiers  # type: ignore[assignment]
        sizes = field_sizes(self.manifest, self._metas, self.fields)
        choice = choose_format(
            resolved,
            sizes.ram_bytes,
            sizes.stored_bytes,
            # packed short items: a batch's windows are one gather out of whole shards
            whole_shards=self.fetch == "shard" or self.manifest.placement is not None,
        )
        tiers.ram_format = choice.format
        # Halve the access counts every few passes over the values (see cache.admission).
        ram_period, ssd_period = admission_periods(sizes, choice.format, self.fetch)
        if tiers.ram is not None:
            tiers.ram.set_period(ram_period)
        if tiers.ssd is not None:
            tiers.ssd.set_period(ssd_period)
        record_format(tiers.node_dir("formats"), self.manifest.store_id, choice)
        return choice

    def _fetch_mode(self, resolved: ResolvedCache | None) -> str:
        mode = resolved.fetch if resolved else "range"
        if mode != "auto":
            return mode
        # A remote store with an SSD tier keeps its chunks in the tier's slots; whole
        # shards where a round trip is long and the tier holds the store (_fetch_mode).
        if not (self.origin.remote and self.tiers is not None and self.tiers.ssd is not None):
            return "range"
        where = self.tiers.node_dir("round-trips")
        if self.ssd_holds_store and whole_shards(self.origin, where, self.manifest.store_id):
            return "shard"
        return "slots"
