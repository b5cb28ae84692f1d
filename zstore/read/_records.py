"""Packed items' batch records, as :class:`zstore.read.reader.WindowReader` reads them:
each record (``zstore_packed/<g>/items.<b>.json``) holds its items' HDF5 attributes and
their arrays stored whole (a scalar label, an embedding: :func:`zstore.format.record_array`).

A record is read once per process while it is among the last :data:`MAX_RECORDS`
used (through the node's tiers where there are any, so the ranks of a node fetch it
from the origin once), and what a read needs from it is kept: the position of each of
its items, their attributes, and the arrays decoded, not the JSON."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from zstore.errors import StoreFormatError
from zstore.format import decode_attrs, record_values

if TYPE_CHECKING:
    from zstore.format import Manifest

#: records a process keeps parsed (a record holds up to 4,096 items; a store of short
#: utterances ~250 per record)
MAX_RECORDS = 256


@dataclass
class Record:
    """What is kept of one batch record."""

    slots: dict[str, int]  # item name -> its index in the record
    entries: dict[str, Any]  # item name -> {"attrs": ...}
    arrays: dict[str, Any]  # array name -> the record's entry (decoded on first use)
    decoded: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)


class BatchRecords:
    """The batch records of one store's packed items, read with ``read(key)`` (the
    record's bytes; FileNotFoundError when it is missing)."""

    def __init__(self, url: str, manifest: Manifest, read: Callable[[str], Any]) -> None:
        self.url, self.manifest, self._read = url, manifest, read
        self._kept: OrderedDict[str, Record] = OrderedDict()
        self._lock = threading.Lock()  # the reader's threads share it

    def attrs(self, position: int) -> dict[str, Any] | None:
        """A packed item's attributes (None: the item is not packed)."""
        with self._lock:
            found = self._record(position)
        if found is None:
            return None
        record, item = found
        return decode_attrs(dict(record.entries.get(item, {}).get("attrs", {})))

    def array(self, position: int, name: str) -> np.ndarray:
        """Array ``name`` of packed item ``position``, stored whole in its record."""
        with self._lock:
            return self._array(position, name)

    def _array(self, position: int, name: str) -> np.ndarray:
        found = self._record(position)
        if found is None:
            raise StoreFormatError(f"{self.url}: item {position} is not packed")
        record, item = found
        values = record.decoded.get(name)
        if values is None:
            entry = record.arrays.get(name)
            try:
                values = record_values(entry) if entry is not None else {}
            except (KeyError, TypeError, ValueError) as e:
                raise StoreFormatError(
                    f"{self.url}: the batch record of item '{item}' holds a damaged "
                    f"'{name}' ({e}); restore it or reconvert the store"
                ) from None
            record.decoded[name] = values
        value = values.get(record.slots[item])
        if value is None:
            raise StoreFormatError(
                f"{self.url}: item '{item}' has no array '{name}'; check the field names"
            )
        return value

    def _record(self, position: int) -> tuple[Record, str] | None:
        placement = self.manifest.placement
        if placement is None or placement.group[position] < 0:
            return None
        group = self.manifest.packs[int(placement.group[position])]
        key = group.record_key(int(placement.batch[position]))
        record = self._kept.get(key)
        if record is None:
            try:
                data = json.loads(bytes(self._read(key)))
            except FileNotFoundError:
                raise StoreFormatError(
                    f"{self.url}/{key} is missing; restore it or reconvert the store"
                ) from None
            items = [str(x) for x in data.get("items", [])]
            record = Record(
                {name: k for k, name in enumerate(items)},
                dict(data.get("entries", {})),
                dict(data.get("arrays", {})),
            )
            self._kept[key] = record
            if len(self._kept) > MAX_RECORDS:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
        return record, self.manifest.items[position]
