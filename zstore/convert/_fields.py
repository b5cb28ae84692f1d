"""Compound HDF5 datasets as one array per field.

Diarization and alignment corpora keep tables in their groups as compound datasets: a
``segments`` of records ``(start f8, end f8, speaker i4)``, or per-frame records of
pitch and energy.  Zarr v3's core data types have no records, so a compound dataset
whose fields are all plain numbers is converted as one array per field, named
``<dataset>.<field>`` (``segments.start``, ``segments.end``, ``segments.speaker``), of
the dataset's shape: stored whole, or a time array like any other where its length
says so.  The scan records which dataset and field each such name reads
(:attr:`zstore.convert._source.SourceItem.fields`); :func:`source_dataset` reads them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: between a compound dataset's name and its field's in the array names
SEPARATOR = "."
#: the kinds of a field that becomes an array (bool, integers, floats, complex)
FIELD_KINDS = "biufc"


def numeric_fields(dtype: np.dtype) -> list[tuple[str, np.dtype]] | None:
    """The fields of a compound ``dtype`` when each is a plain number (no nested
    record, no per-field shape); else None."""
    if not dtype.names:
        return None
    out = []
    for name in dtype.names:
        field = dtype.fields[name][0]  # type: ignore[index]
        if field.names or field.shape or field.kind not in FIELD_KINDS:
            return None
        out.append((name, field))
    return out


class FieldView:
    """One field of a compound h5py dataset, read like a dataset of its own."""

    def __init__(self, ds: Any, field: str) -> None:
        self.ds, self.field = ds, field
        self.shape = tuple(ds.shape)
        self.dtype = np.dtype(ds.dtype.fields[field][0])
        # the table's attributes go with each of its fields
        self.attrs, self.id, self.file = ds.attrs, ds.id, ds.file
        self.dims = ds.dims
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape))

    def __getitem__(self, key: Any) -> np.ndarray:
        return np.asarray(self.ds.fields(self.field)[key], dtype=self.dtype)


#: in an item's ``fields``: the array is the item's HDF5 object itself, a dataset (an
#: item of a file of one dataset per recording, ``dataset_items``)
ITSELF = ("", "")


def source_dataset(group: Any, fields: dict[str, tuple[str, str]], name: str) -> Any:
    """Array ``name`` of an HDF5 ``group``: its dataset, or a :class:`FieldView` where
    ``fields`` (the item's) says it is a compound dataset's field; the item's object
    itself where they say :data:`ITSELF`; the dataset at a path below the group where
    they give one with no field (a subgroup's dataset, :mod:`zstore.convert._subgroups`)."""
    where = fields.get(name)
    if where is None:
        return group[name]
    dataset, field = where
    if not field:  # a dataset at another path below the group (or the group itself)
        return group[dataset] if dataset else group
    return FieldView(group[dataset], field)
