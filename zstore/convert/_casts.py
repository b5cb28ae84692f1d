"""Float arrays stored in another float dtype than the source's (``--dtype wav=float32``).

Processed audio often comes as float64 (numpy's default), twice the bytes of float32
in the store, in the RAM tier and in every batch, for precision no model uses; and a
corpus assembled from several pipelines may hold float32 in some groups and float64 in
others, which one array cannot.  A cast names the dtype the store keeps: every item's
values are converted to it (to nearest) before they are encoded, the manifest and the
arrays' metadata say the new dtype, ``--verify`` compares the cast values, and appends
cast new items as the store's were (the manifest keeps the casts).  Every path casts
with numpy (values read in the file's dtype, then cast), so packed and unpacked items
hold the same values, and a value beyond the new dtype's range stops the conversion.
"""

from __future__ import annotations

import numpy as np

from zstore.convert._source import SourceItem
from zstore.errors import SourceError

#: the dtypes a float array may be stored as
CAST_TO = ("float16", "float32", "float64")


def apply_casts(
    items: list[SourceItem], casts: dict[str, str], where: str, optional: bool = False
) -> None:
    """Check ``casts`` ({array: dtype}) against the scanned ``items`` and make each
    item's array of that name the cast dtype, the file's kept in ``cast_from`` (read in
    it, then cast by :func:`cast_values`).  ``optional``: the items may lack a cast
    array (an append)."""
    names = sorted({n for it in items for n in it.shapes})
    for name, target in casts.items():
        if name not in names and optional:
            continue
        if name not in names:
            raise SourceError(
                f"--dtype {name}={target}: {where} has no array named '{name}' "
                f"(arrays: {', '.join(names)})"
            )
        if target not in CAST_TO:
            raise SourceError(
                f"--dtype {name}={target}: a float array is stored as one of {', '.join(CAST_TO)}"
            )
        kinds = sorted({np.dtype(it.dtypes[name]).name for it in items if name in it.dtypes})
        if any(np.dtype(k).kind != "f" for k in kinds):
            raise SourceError(
                f"--dtype {name}={target}: '{name}' is {'/'.join(kinds)}; only float arrays "
                "are cast (integers keep their exact values): leave it out"
            )
        for it in items:
            if name in it.dtypes and np.dtype(it.dtypes[name]).newbyteorder("=") != target:
                it.cast_from[name] = np.dtype(it.dtypes[name])
                it.dtypes[name] = np.dtype(target)


def cast_text(name: str, items: list[SourceItem]) -> str | None:
    """The dtypes ``name`` was cast from, as the report says them; None: no cast."""
    found = sorted({it.cast_from[name].name for it in items if name in it.cast_from})
    return "/".join(found) or None


def cast_values(dtype: str | None, data: np.ndarray, what: str = "the array") -> np.ndarray:
    """``data`` as the array's stored ``dtype`` where a cast makes it another float
    dtype (byte order aside), to nearest; itself otherwise.  Finite values beyond the
    new dtype's range are refused (they would become infinities), naming ``what``."""
    if dtype is None or data.dtype.kind != "f":
        return data
    target = np.dtype(dtype)
    if target.kind != "f" or data.dtype.newbyteorder("=") == target:
        return data
    top = float(np.finfo(target).max)
    if target.itemsize < data.dtype.itemsize and data.size:
        finite = data[np.isfinite(data)]
        largest = float(np.abs(finite).max()) if finite.size else 0.0
        if largest > top:
            raise SourceError(
                f"{what} holds values up to {largest:g}, beyond "
                f"{target.name}'s range (±{top:g}): cast, they would become infinities; "
                f"leave --dtype out for this array"
            )
    return data.astype(target)
