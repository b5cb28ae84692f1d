"""Packed items' batch records, as :class:`zstore.read.reader.WindowReader` reads them:
each record (``zstore_packed/<g>/items.<b>.json``) holds its items' HDF5 attributes and
their arrays stored whole (a scalar label, an embedding: :func:`zstore.format.record_array`).

A record is read once per process (through the node's tiers where there are any, so the
ranks of a node fetch it from the origin once) and only what windows need is kept: its
items' positions in the store and its arrays decoded, stacked where their shapes agree
(~20 bytes an item for a scalar label), not the JSON.  Every record of a store of
millions of items fits: a record parsed again on each window cost ~0.7 ms, and a store
with more records than a process kept read its labels 35x slower than its audio.  The
items' attributes are kept as columns (:mod:`zstore.read._record_columns`)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from zstore.errors import StoreFormatError
from zstore.format import record_values
from zstore.read._record_columns import RecordColumns, Rows

if TYPE_CHECKING:
    from zstore.format import Manifest

#: records whose arrays a process keeps (a store of 1M items of ~1 s has ~4,000)
MAX_RECORDS = 1 << 16


@dataclass
class Record:
    """What is kept of one batch record: where its items lie in it, and per array
    stored whole, per item slot, its row in the array's values (-1: the item lacks it)
    and the values."""

    at: Rows
    arrays: dict[str, tuple[np.ndarray, np.ndarray | list[np.ndarray]]]

    def slot(self, position: int) -> int:
        return self.at.slot(position)


class BatchRecords:
    """The batch records of one store's packed items, read with ``read(key)`` (the
    record's bytes; FileNotFoundError when it is missing)."""

    def __init__(self, url: str, manifest: Manifest, read: Callable[[str], Any]) -> None:
        self.url, self.manifest, self._read = url, manifest, read
        self._kept: OrderedDict[str, Record] = OrderedDict()
        self._lock = threading.Lock()  # the reader's threads share it
        #: the items' attributes
        self.columns = RecordColumns(self._load, self._rows)

    def attrs(self, position: int) -> dict[str, Any] | None:
        """A packed item's attributes (None: the item is not packed)."""
        key = self._key(position)
        return None if key is None else self.columns.attrs(key, position)

    def named(self, position: int, names: Sequence[str]) -> dict[str, Any] | None:
        """Attributes ``names`` of a packed item, those it has (None: the item is not
        packed)."""
        key = self._key(position)
        return None if key is None else self.columns.named(key, position, names)

    def array(self, position: int, name: str) -> np.ndarray:
        """Array ``name`` of packed item ``position``, stored whole in its record."""
        key = self._key(position)
        if key is None:
            raise StoreFormatError(f"{self.url}: item {position} is not packed")
        with self._lock:
            record = self._kept.get(key)
            if record is None:
                record = self._kept[key] = self._record(key, position)
                if len(self._kept) > MAX_RECORDS:
                    self._kept.popitem(last=False)
            else:
                self._kept.move_to_end(key)
        rows, values = record.arrays.get(name, (None, []))
        row = -1 if rows is None else int(rows[record.slot(position)])
        if row < 0:
            raise StoreFormatError(
                f"{self.url}: item '{self.manifest.items[position]}' has no array "
                f"'{name}'; check the field names"
            )
        return values[row, ...] if isinstance(values, np.ndarray) else values[row]  # 0-d kept

    def _key(self, position: int) -> str | None:
        placement = self.manifest.placement
        if placement is None or placement.group[position] < 0:
            return None
        group = self.manifest.packs[int(placement.group[position])]
        return group.record_key(int(placement.batch[position]))

    def _load(self, key: str) -> dict[str, Any]:
        try:
            data = json.loads(bytes(self._read(key)))
        except FileNotFoundError:
            raise StoreFormatError(
                f"{self.url}/{key} is missing; restore it or reconvert the store"
            ) from None
        if not isinstance(data, dict):
            raise StoreFormatError(f"{self.url}/{key} is not a batch record; reconvert the store")
        return data

    def _rows(self, position: int, data: dict[str, Any]) -> Rows:
        """Where the items of a record (``data``; it holds item ``position``) lie in it."""
        placement = self.manifest.placement
        assert placement is not None
        g, b = int(placement.group[position]), int(placement.batch[position])
        positions = np.flatnonzero((placement.group == g) & (placement.batch == b))
        names = [str(x) for x in data.get("items", [])]
        slots = None
        if [self.manifest.items[int(p)] for p in positions] != names:  # not in store order
            where = {n: i for i, n in enumerate(self.manifest.items)}
            slots = {where[n]: k for k, n in enumerate(names) if n in where}
        return Rows(positions, slots, names)

    def _record(self, key: str, position: int) -> Record:
        """Record ``key`` (which holds item ``position``) read, and kept compact."""
        data = self._load(key)
        at = self._rows(position, data)
        names = at.names
        arrays: dict[str, tuple[np.ndarray, np.ndarray | list[np.ndarray]]] = {}
        for name, entry in dict(data.get("arrays", {})).items():
            try:
                by_slot = record_values(entry)
            except (KeyError, TypeError, ValueError) as e:
                raise StoreFormatError(
                    f"{self.url}/{key}: its '{name}' (stored whole) is damaged ({e}); "
                    "restore it or reconvert the store"
                ) from None
            rows = np.full(len(names), -1, dtype=np.int32)
            values = list(by_slot.values())
            for row, k in enumerate(by_slot):
                rows[k] = row
            shapes = {v.shape for v in values}
            stacked = np.stack(values) if len(shapes) == 1 and values else values
            arrays[name] = (rows, stacked)
        return Record(at, arrays)
