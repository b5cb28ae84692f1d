"""Where an item's arrays are, for :class:`zstore.read.reader.WindowReader`: their
geometries (from the manifest, the consolidated metadata or the arrays' ``zarr.json``),
a packed item's place in its pack group's array, and the items' HDF5 attributes."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Self

from zstore.errors import StoreFormatError
from zstore.format import ArrayLayout, PackGroup, decode_attrs, packed_meta, parse_array_meta

if TYPE_CHECKING:
    from zstore.cache import TieredCache
    from zstore.format import Manifest
    from zstore.format.manifest import ArrayMetas
    from zstore.origin import Origin

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
        _records: dict[str, Any]

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
            if meta is None:
                try:
                    key = f"{path}/zarr.json"
                    raw = (
                        self.tiers.get(key, lambda: self.origin.read(key))
                        if self.tiers is not None
                        else self.origin.read(key)
                    )
                    meta = json.loads(bytes(raw))
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
        packed = self._packed_record(position)
        if packed is not None:
            return packed
        meta = self._metas.group(position)
        if meta is None:
            meta = self._stored_json(f"{self.manifest.items[position]}/zarr.json")
        return decode_attrs(dict(meta.get("attributes", {})))

    def _packed_record(self, position: int) -> dict[str, Any] | None:
        """A packed item's attributes, from its batch's record (None: not packed)."""
        placement = self.manifest.placement
        if placement is None or placement.group[position] < 0:
            return None
        group = self.manifest.packs[int(placement.group[position])]
        key = group.record_key(int(placement.batch[position]))
        record = self._records.get(key)
        if record is None:
            record = self._stored_json(key)
            if len(self._records) >= 64:
                self._records.clear()
            self._records[key] = record
        entry = record.get("entries", {}).get(self.manifest.items[position], {})
        return decode_attrs(dict(entry.get("attrs", {})))

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
