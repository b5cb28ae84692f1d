"""Where an item's arrays are, for :class:`zstore.read.reader.WindowReader`: their
geometries (from the manifest, the consolidated metadata or the arrays' ``zarr.json``),
a packed item's place in its pack group's array, and the items' HDF5 attributes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from zstore.errors import StoreFormatError
from zstore.format import (
    ArrayLayout,
    PackGroup,
    data_type,
    decode_attrs,
    packed_meta,
    parse_array_meta,
)

if TYPE_CHECKING:
    from zstore.cache import TieredCache
    from zstore.format import Manifest
    from zstore.format.manifest import ArrayMetas
    from zstore.origin import Origin
    from zstore.read._chunks import ChunkSource
    from zstore.read._records import BatchRecords

MAX_LAYOUTS = 8192  # item geometries a process keeps (each rebuilt from the manifest in ~50 us)


class ItemPlaces:
    """The part of :class:`zstore.read.reader.WindowReader` that finds an item's arrays."""

    if TYPE_CHECKING:
        url: str
        manifest: Manifest
        origin: Origin
        tiers: TieredCache | None
        _metas: ArrayMetas
        _layouts: dict[tuple[str, str], ArrayLayout]
        records: BatchRecords
        source: ChunkSource

        def open(self) -> Self: ...

    def layout(self, item: str, name: str, position: int | None = None) -> ArrayLayout:
        """The geometry of ``item/name``: from the manifest (format 2) or the
        consolidated metadata (format 1), else from the array's ``zarr.json``.
        ``position``, the item's index when the caller knows it, saves a name lookup."""
        self.open()
        found = self._layouts.get((item, name))
        if found is None:
            if len(self._layouts) >= MAX_LAYOUTS:  # bounded, whatever the item count
                self._layouts.clear()
            path = f"{item}/{name}"
            meta = (
                self._metas.get(path)
                if position is None or self.manifest.shapes is None
                else self._metas.at(position, name)
            )
            if meta is None and self.manifest.placement is not None:
                if position is None:
                    position = self.manifest.position(item)
                if self.in_record(position, name):  # no zarr.json: its shape and dtype
                    meta = self._record_meta(position, name)
            if meta is None:
                try:
                    meta = json.loads(bytes(self._stored_bytes(f"{path}/zarr.json")))
                except FileNotFoundError:
                    raise StoreFormatError(
                        f"{self.url}: item '{item}' has no array '{name}'; check the field names"
                    ) from None
            info = self.manifest.arrays.get(name)
            found = parse_array_meta(
                path, meta, info.time_axis if info else None, info.values if info else None
            )
            self._layouts[(item, name)] = found
        return found

    def item_attrs(self, position: int) -> dict[str, Any]:
        """The attributes of item ``position`` (its HDF5 group's), read from its group."""
        self.open()
        packed = self.records.attrs(position)  # a packed item's: its batch record's
        if packed is not None:
            return packed
        meta = self._metas.group(position)
        if meta is None:
            meta = self._stored_json(f"{self.manifest.items[position]}/zarr.json")
        return decode_attrs(dict(meta.get("attributes", {})))

    def item_named_attrs(self, position: int, names: Sequence[str]) -> dict[str, Any]:
        """Attributes ``names`` of item ``position``, those it has: a packed item's from
        its batch record's columns, which this process keeps for every record."""
        self.open()
        packed = self.records.named(position, names)
        if packed is not None:
            return packed
        have = self.item_attrs(position)
        return {k: have[k] for k in names if k in have}

    def in_record(self, position: int | None, name: str) -> bool:
        """Whether array ``name`` of item ``position`` is kept in its batch's record:
        an array stored whole (no time axis) of a packed item."""
        placement = self.manifest.placement
        if placement is None or position is None or int(placement.group[position]) < 0:
            return False
        info = self.manifest.arrays.get(name)
        return info is not None and (info.rate is None or info.time_axis is None)

    def _record_meta(self, position: int, name: str) -> dict[str, Any]:
        """A ``zarr.json`` document that says the shape and dtype of a packed item's
        array kept in its record (read from the record, never as chunks)."""
        assert self.manifest.shapes is not None  # format 2: packed items have a table
        shape = [int(x) for x in self.manifest.shapes[name][position]]
        if min(shape, default=0) < 0:
            raise StoreFormatError(
                f"{self.url}: item '{self.manifest.items[position]}' has no array "
                f"'{name}'; check the field names"
            )
        dtype = np.dtype(self.manifest.arrays[name].dtype or "V1")
        return {"shape": shape, "data_type": data_type(dtype), "codecs": []}

    def _stored_bytes(self, key: str) -> Any:
        """The bytes of object ``key`` of the store, through the tiers where there are
        any (FileNotFoundError when the store has none); read from the origin, they are
        checked to be the opened store's (a batch record holds values)."""

        def fetch() -> bytes:
            data = self.origin.read(key)
            self.check_root()
            return data

        return self.tiers.get(key, fetch) if self.tiers is not None else fetch()

    def check_root(self) -> None:
        """Raise :class:`zstore.errors.StoreReplacedError` unless the store at the URL is
        still the one opened: after values were read past the chunk rounds (which check
        it beside them; :mod:`zstore.read._replaced`), so they are the opened store's."""
        if self.source.check is not None:
            self.source.check.now(self.origin)

    def placed(
        self, item: str, name: str, position: int | None = None
    ) -> tuple[ArrayLayout, int, int]:
        """The layout that holds ``item/name``, the item's offset in it along time and
        its length: its own array, or for a packed item its pack group's array."""
        self.open()
        if self.manifest.placement is not None and position is None:
            position = self.manifest.position(item)
        packed = (
            self.manifest.packed(position, name)
            if position is not None and self.manifest.placement is not None
            else None
        )
        if packed is None:
            layout = self.layout(item, name, position)
            return layout, 0, layout.length
        group, offset = packed
        if offset < 0:
            raise StoreFormatError(
                f"{self.url}: item '{item}' has no array '{name}'; check the field names"
            )
        assert self.manifest.shapes is not None and position is not None
        shape = self.manifest.shapes[name][position]
        info = self.manifest.arrays[name]
        axis = (info.time_axis or 0) % len(shape)  # a packed array is a time array
        return self.pack_layout(group, name), offset, int(shape[axis])

    def pack_layout(self, group: PackGroup, name: str) -> ArrayLayout:
        """The geometry of a pack group's array (one per array, shared by its items)."""
        key = (group.path, name)
        found = self._layouts.get(key)
        if found is None:
            info = self.manifest.arrays[name]
            found = parse_array_meta(
                group.array_path(name),
                packed_meta(group, name, info, self.manifest.codec, self.manifest.chunk_seconds),
                info.time_axis,
                info.values,
            )
            self._layouts[key] = found
        return found

    def _stored_json(self, key: str) -> Any:
        """The JSON object ``key`` of the store, which the store must hold."""
        try:
            return json.loads(self.origin.read(key))
        except FileNotFoundError:
            raise StoreFormatError(
                f"{self.url}/{key} is missing; restore it or reconvert the store"
            ) from None
