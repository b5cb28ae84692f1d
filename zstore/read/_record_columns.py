"""Packed items' attributes, as :class:`zstore.read._records.BatchRecords` keeps them:
compact columns of each batch record's items (:class:`Column`), kept for every record a
process reads, within :data:`MAX_COLUMN_BYTES`.

A record holds its ~400 items' attributes as JSON (~54 KB).  Kept as parsed dicts for
the last 64 records, a store of more records read each window's transcript
(``attrs=["text"]``) by parsing its record again (~1 ms): 1,100-1,300 windows/s where
its audio read 9,000-13,000 (50,000 packed utterances, one process).  As columns a
transcript costs its UTF-8 bytes and 8 more, and a corpus's transcripts stay in the
process (docs/benchmarks-notes.md, "Attributes of packed items with each window").
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zstore.format import decode_attrs

#: bytes of attributes a process keeps, as columns (the transcripts of ~1M utterances
#: of ~200 characters)
MAX_COLUMN_BYTES = 256 << 20


class Column:
    """One attribute of a record's items, in the record's item order: strings as one
    UTF-8 blob and offsets, whole numbers, floats or booleans (all of one kind) as an
    array, anything else as a list; an item that lacks it is marked absent."""

    def __init__(self, values: list[Any], present: list[bool]) -> None:
        self.present = np.asarray(present, dtype=bool)
        self.blob: bytes | None = None
        self.offsets: np.ndarray | None = None
        self.values: np.ndarray | list[Any]
        kinds = {type(v) for v, p in zip(values, present) if p}
        if kinds == {str}:
            parts = [
                v.encode("utf-8", "surrogatepass") if p else b"" for v, p in zip(values, present)
            ]
            self.offsets = np.zeros(len(parts) + 1, dtype=np.int64)
            np.cumsum([len(b) for b in parts], out=self.offsets[1:])
            self.blob = b"".join(parts)
            self.values = []
            self.nbytes = len(self.blob) + self.offsets.nbytes + self.present.nbytes
            return
        self.values = list(values)
        if len(kinds) == 1 and kinds <= {int, float, bool}:
            fill = kinds.pop()()
            stacked = np.asarray([v if p else fill for v, p in zip(values, present)])
            if stacked.dtype != object:  # whole numbers beyond int64 stay as they are
                self.values = stacked
        if isinstance(self.values, np.ndarray):
            self.nbytes = self.values.nbytes + self.present.nbytes
        else:
            self.nbytes = 64 * len(self.values) + self.present.nbytes  # a rough bound

    def get(self, row: int) -> tuple[bool, Any]:
        """(whether the item has it, its value)."""
        if not self.present[row]:
            return False, None
        if self.blob is not None:
            assert self.offsets is not None
            a, b = int(self.offsets[row]), int(self.offsets[row + 1])
            return True, self.blob[a:b].decode("utf-8", "surrogatepass")
        if isinstance(self.values, np.ndarray):
            return True, self.values[row].item()
        value = self.values[row]
        return True, copy.deepcopy(value) if isinstance(value, (list, dict)) else value


@dataclass
class Rows:
    """Where a record's items lie in it: their store positions in store order, the
    record's slot of each position where the record has another order, and the item
    names in the record's order."""

    positions: np.ndarray
    slots: dict[int, int] | None
    names: list[str]

    def slot(self, position: int) -> int:
        if self.slots is not None:
            return self.slots[position]
        return int(np.searchsorted(self.positions, position))


class RecordColumns:
    """The columns of the batch records' attributes this process read: ``load(key)``
    gives a record's JSON, ``rows(position, data)`` where its items lie in it."""

    def __init__(
        self,
        load: Callable[[str], dict[str, Any]],
        rows: Callable[[int, dict[str, Any]], Rows],
    ) -> None:
        self._load, self._rows = load, rows
        #: record key -> the names of its items' attributes, while all their columns are kept
        self._names: dict[str, list[str]] = {}
        #: (record key, attribute name) -> (where the record's items lie, column)
        self._columns: OrderedDict[tuple[str, str], tuple[Rows, Column]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the reader's threads share it

    def attrs(self, key: str, position: int) -> dict[str, Any]:
        """The attributes of item ``position`` of record ``key``, from the columns of
        every attribute its record's items have."""
        with self._lock:
            names = self._names.get(key)  # dropped when one of its columns is let go of
            if names is None:
                names = self._names[key] = self._add_columns(key, position, None)
        return self._values(key, position, names)

    def named(self, key: str, position: int, names: Sequence[str]) -> dict[str, Any]:
        """Attributes ``names`` of item ``position`` of record ``key``, those it has."""
        with self._lock:
            missing = [n for n in names if (key, n) not in self._columns]
            if missing:
                self._add_columns(key, position, missing)
        return self._values(key, position, names)

    def _values(self, key: str, position: int, names: Sequence[str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        at: Rows | None = None
        row = 0
        with self._lock:
            for name in names:
                found = self._columns.get((key, name))
                if found is None:  # let go of meanwhile (the byte bound): read it again
                    self._add_columns(key, position, [name])
                    found = self._columns[(key, name)]
                self._columns.move_to_end((key, name))
                if found[0] is not at:  # one record's columns share their rows
                    at, row = found[0], found[0].slot(position)
                has, value = found[1].get(row)
                if has:
                    out[name] = value
        return out

    def _add_columns(self, key: str, position: int, names: list[str] | None) -> list[str]:
        """Columns ``names`` of record ``key`` (which holds item ``position``; None: every
        attribute its items have), added; the names."""
        data = self._load(key)
        at = self._rows(position, data)
        entries = dict(data.get("entries", {}))
        attrs = [decode_attrs(dict(entries.get(n, {}).get("attrs", {}))) for n in at.names]
        if names is None:
            names = list(dict.fromkeys(k for a in attrs for k in a))
        for name in names:
            present = [name in a for a in attrs]
            column = Column([a.get(name) for a in attrs], present)
            old = self._columns.pop((key, name), None)
            if old is not None:
                self._bytes -= old[1].nbytes
            self._columns[(key, name)] = (at, column)
            self._bytes += column.nbytes
        while self._bytes > MAX_COLUMN_BYTES and len(self._columns) > len(names):
            (record, _), (_, gone) = self._columns.popitem(last=False)
            self._bytes -= gone.nbytes
            self._names.pop(record, None)
        return names
