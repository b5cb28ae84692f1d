"""Zarr ``dimension_names`` for the converted arrays, from the HDF5 source: an axis's
label or the name of the dimension scale attached to it, else names that let xarray open
an item group whose arrays run at different rates."""

from __future__ import annotations

from typing import Any

from zstore.convert._fields import source_dataset
from zstore.convert._source import SourceItem, open_source
from zstore.format import ArrayInfo


def dimension_names(
    items: list[SourceItem], arrays: dict[str, ArrayInfo]
) -> dict[str, tuple[str, ...]]:
    """Each array's Zarr ``dimension_names``: an axis's HDF5 label, or the name of the
    dimension scale attached to it, else ``<array>_time`` for the time axis and
    ``<array>_dim<k>`` for the others.  Arrays of one item are at different rated, so a
    label two arrays share names one dimension only where it has one size in both (the
    time axes of one rate, or other axes of one length); otherwise it is qualified with
    the array's name (``act_time``), so xarray can open an item group."""
    first: dict[str, SourceItem] = {}
    for it in items:
        for n in it.shapes:
            first.setdefault(n, it)
    labels = _labels(first)
    used: dict[str, tuple[Any, ...]] = {}
    out: dict[str, tuple[str, ...]] = {}
    for n, info in arrays.items():
        if n not in first:
            continue
        shape = first[n].shapes[n]
        names = []
        for axis in range(len(shape)):
            timed = info.rate is not None and info.time_axis == axis
            label = labels.get(n, [None] * len(shape))[axis]
            if label:
                key = ("time", info.rate) if timed else ("size", shape[axis])
                if used.setdefault(label, key) != key:
                    label = f"{n}_{label}"
            names.append(label or (f"{n}_time" if timed else f"{n}_dim{axis}"))
        if len(set(names)) != len(names):  # one label on two axes of one array
            names = [f"{name}_{axis}" for axis, name in enumerate(names)]
        out[n] = tuple(names)
    return out


def _labels(first: dict[str, SourceItem]) -> dict[str, list[str | None]]:
    """Per array, each axis's label or attached scale's name in its first item."""
    by_file: dict[str, list[str]] = {}
    for n, it in first.items():
        by_file.setdefault(it.source, []).append(n)
    out: dict[str, list[str | None]] = {}
    for source, names in by_file.items():
        with open_source(source) as f:
            for n in names:
                ds = source_dataset(f[first[n].group], first[n].fields, n)
                got: list[str | None] = []
                for dim in ds.dims:
                    label = dim.label
                    if not label and len(dim):
                        try:
                            label = str(dim[0].name).rsplit("/", 1)[-1]
                        except (KeyError, ValueError, RuntimeError, OSError):
                            label = ""
                    got.append(label or None)
                out[n] = got
    return out
