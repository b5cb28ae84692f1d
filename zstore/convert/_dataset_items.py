"""Files of one dataset per recording (``/utt0``, ``/audio/utt1``, ... rather than a
group each): with ``convert(dataset_items="wav")`` the scan makes every numeric dataset
an item named by its path, holding one array ``wav`` that is the dataset itself
(:data:`zstore.convert._fields.ITSELF`), its attributes the item's.  Datasets of another
number of dimensions than most (a scalar sample rate beside 2-d recordings) are left
out, with the reason.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from zstore.convert._fields import ITSELF
from zstore.convert._source import NUMERIC_KINDS, SourceItem, non_numeric


def dataset_items(
    found: list[tuple[str, tuple[int, ...], np.dtype]],
    name: str,
    path: str,
    identity: tuple[int, int, int] | None,
    attrs: dict[str, int],
) -> tuple[list[SourceItem], list[str]]:
    """Every numeric dataset of ``found`` as an item named by its path, holding one
    array ``name``: the dataset itself (:data:`zstore.convert._fields.ITSELF`), its
    attributes the item's."""
    items, skipped, numeric = [], [], []
    for full, shape, dtype in found:
        if dtype.kind in NUMERIC_KINDS and not dtype.names:
            numeric.append((full, shape, dtype))
        else:
            skipped.append(f"{full}: {non_numeric(dtype)}")
    # the recordings' number of dimensions: most datasets have it (a scalar sample rate
    # or a metadata table beside them is not a recording)
    ndims = Counter(len(shape) for _, shape, _ in numeric)
    ndim = max(ndims, key=lambda n: (ndims[n], n)) if ndims else 0
    for full, shape, dtype in numeric:
        if len(shape) != ndim:
            skipped.append(
                f"{full}: {len(shape)}-d, where {ndims[ndim]} dataset(s) are {ndim}-d "
                f"recordings (--dataset-items {name})"
            )
            continue
        items.append(
            SourceItem(
                full,
                {name: shape},
                {name: dtype},
                math.prod(shape) * dtype.itemsize,
                path,
                full,
                {},
                {"": attrs[full]} if full in attrs else {},
                identity,
                {name: ITSELF},
            )
        )
    items.sort(key=lambda it: it.name)
    return items, skipped
