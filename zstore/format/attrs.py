"""HDF5 attributes as strict JSON in ``zarr.json``, and back.

Every JSON parser must read a converted store's metadata (zarrs and TensorStore refuse
bare ``NaN``; xarray and zarr-python read what the Zarr v3 spec allows), so attributes
are written as strict JSON:

- NaN and the infinities become the strings ``"NaN"``, ``"Infinity"`` and
  ``"-Infinity"`` (as Zarr v3 writes float fill values); the attribute's name is listed
  in the group's or array's ``"zstore_nonfinite"`` attribute, and zstore reads those
  strings back as floats (:func:`decode_attrs`);
- HDF5 object and region references (dimension scales keep them in ``DIMENSION_LIST``
  and ``REFERENCE_LIST``) become the path of the object they point to (a region
  reference: the path of its dataset); a reference that leads nowhere becomes null;
- bytes become text (UTF-8, undecodable bytes replaced); numpy scalars and arrays
  become numbers and lists; structured (compound) values become lists of their fields;
  anything else becomes its ``str``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import h5py
import numpy as np

from zstore.format.layout import DIGEST_ATTR, DONE_ATTR

NONFINITE_ATTR = "zstore_nonfinite"
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def hdf5_attrs(obj: Any) -> dict[str, Any]:
    """The attributes of an h5py group or dataset, as strict JSON values."""
    if not h5py.h5a.get_num_attrs(obj.id):  # most have none: skip building the view
        return {}
    return _strict(obj.attrs.items(), obj.file)


def text_attrs(
    loc: Any, names: Sequence[str], attrs: dict[str, Any], under: str = ""
) -> dict[str, Any]:
    """String datasets ``names`` of a group as attributes: a text, or a list of texts.
    ``loc``: the low-level h5py id of the group, or of the file with ``under`` the
    group's path and a slash.  A name the group's attributes ``attrs`` have already is
    left to the attribute.  Read through h5py's low-level API (~30 us a dataset against
    ~120 us through ``group[name][()]``: on short items, half their conversion)."""
    out: dict[str, Any] = {}
    for name in names:
        if name in attrs:
            continue
        did = h5py.h5d.open(loc, f"{under}{name}".encode("utf-8", "surrogateescape"))
        data = np.empty(did.shape, dtype=did.dtype)  # object (variable length) or bytes
        if data.size:
            did.read(h5py.h5s.ALL, h5py.h5s.ALL, data)
        if data.dtype == np.uint16:  # a MATLAB char array (zstore.convert._scan)
            out[name] = matlab_text(data)
            continue
        out[name] = _value(data[()] if data.ndim == 0 else data, None, [False])
    return out


def matlab_text(codes: np.ndarray) -> str | list[str]:
    """A MATLAB char array's text: its UTF-16 codes as h5py reads them, MATLAB's
    column-major (rows, columns) stored as (columns, rows).  One row is a string; a
    char matrix is a list of its rows, their padding blanks stripped on the right."""
    rows = [
        np.ascontiguousarray(row, dtype="<u2").tobytes().decode("utf-16-le", "replace")
        for row in codes.T
    ]
    return rows[0] if len(rows) == 1 else [r.rstrip(" ") for r in rows]


def _strict(values: Any, file: Any) -> dict[str, Any]:
    """``(name, value)`` pairs as strict JSON values, non-finite floats listed under
    :data:`NONFINITE_ATTR` (``file`` resolves references)."""
    out: dict[str, Any] = {}
    nonfinite = []
    for key, value in values:
        flag = [False]
        out[key] = _value(value, file, flag)
        if flag[0]:
            nonfinite.append(key)
    if nonfinite:
        out[NONFINITE_ATTR] = nonfinite
    return out


def hdf5_attrs_of(oid: Any, high: Callable[[], Any]) -> dict[str, Any]:
    """:func:`hdf5_attrs` of a low-level h5py object id: numeric attributes are read
    through h5py's low-level API (half the cost of its attribute manager, which was a
    fifth of a short item's conversion); any other kind takes :func:`hdf5_attrs` of
    ``high()``, the high-level object."""
    return _low_level(
        lambda i: h5py.h5a.open(oid, index=i, index_type=_BY_NAME, order=_NATIVE),
        h5py.h5a.get_num_attrs(oid),
        high,
    )


def hdf5_attrs_at(fid: Any, path: str, count: int, high: Callable[[], Any]) -> dict[str, Any]:
    """:func:`hdf5_attrs_of` the object at ``path`` in the file ``fid``, which has
    ``count`` attributes, without opening the object (~25 us an object: on short items
    the attributes are most of what HDF5 is asked for)."""
    where = path.encode("utf-8", "surrogateescape")
    return _low_level(
        lambda i: h5py.h5a.open(fid, obj_name=where, index=i, index_type=_BY_NAME, order=_NATIVE),
        count,
        high,
    )


_BY_NAME, _NATIVE = h5py.h5.INDEX_NAME, h5py.h5.ITER_NATIVE


def _low_level(
    open_attr: Callable[[int], Any], count: int, high: Callable[[], Any]
) -> dict[str, Any]:
    if not count:
        return {}
    values = []
    for i in range(count):
        aid = open_attr(i)
        dtype, space = aid.dtype, aid.get_space()
        if (
            dtype.kind not in "biuf"
            or dtype.names is not None
            or dtype.subdtype is not None
            or space.get_simple_extent_type() == h5py.h5s.NULL
        ):
            return hdf5_attrs(high())
        data = np.empty(space.shape, dtype=dtype)
        if data.size:
            aid.read(data)
        name = aid.name.decode("utf-8", "surrogateescape")
        values.append((name, data[()] if data.ndim == 0 else data))
    values.sort(key=lambda kv: kv[0])  # in name order, as h5py lists them
    return _strict(values, None)  # numbers: no references to resolve


def _value(value: Any, file: Any, flag: list[bool]) -> Any:
    if isinstance(value, h5py.Empty):  # an attribute with a type and no value
        return None
    if isinstance(value, (h5py.Reference, h5py.RegionReference)):
        return _target(value, file)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "biu":
            return value.tolist()
        return (
            [_value(v, file, flag) for v in value.tolist()]
            if value.ndim
            else _value(value.item(), file, flag)
        )
    if isinstance(value, np.void):
        return [_value(v, file, flag) for v in value.tolist()]
    if isinstance(value, np.generic):
        return _value(value.item(), file, flag)
    if isinstance(value, (list, tuple)):
        return [_value(v, file, flag) for v in value]
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        flag[0] = True
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, complex):
        return [_value(value.real, file, flag), _value(value.imag, file, flag)]
    return value if isinstance(value, (str, int, bool, type(None))) else str(value)


def _target(ref: Any, file: Any) -> str | None:
    """The path of the object an HDF5 reference points to (None for a null one)."""
    if not ref:
        return None
    try:
        return str(file[ref].name)
    except (ValueError, KeyError, OSError, RuntimeError):
        return None


def decode_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """Attributes as written by :func:`hdf5_attrs`, with NaN and infinities back as
    floats (only under the names ``"zstore_nonfinite"`` lists), and without zstore's own
    marks (that list, and the converter's mark of a finished item and its checksum)."""
    names = attrs.get(NONFINITE_ATTR)
    out = {k: v for k, v in attrs.items() if k not in (NONFINITE_ATTR, DONE_ATTR, DIGEST_ATTR)}
    if not isinstance(names, list):
        return out
    for name in names:
        if name in out:
            out[name] = _floats(out[name])
    return out


def _floats(value: Any) -> Any:
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, list):
        return [_floats(v) for v in value]
    return value
