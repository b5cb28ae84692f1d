"""``zstore info``: a store's manifest in a few lines."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from zstore.convert._copies import DIGESTS, copies, copies_text, unpack_digests
from zstore.errors import ZstoreError
from zstore.format import (
    ArrayInfo,
    Manifest,
    packed_meta,
    parse_array_meta,
    read_manifest,
    stored_objects,
)
from zstore.units import format_size


def _values_line(a: ArrayInfo) -> str | None:
    """What a float array's values are and its stated precision, with the SNR measured
    while converting."""
    values = {
        "int16": "values are int16 samples (x / 32768)",
        "int24": "values are int24 samples (x / 2**23)",
        "whole": "values are whole numbers",
        "float": "true float values",
    }.get(a.values or "")
    if a.precision is None:
        return f"{values}, stored lossless" if values else None
    return f"{values + ', ' if values else ''}precision {a.precision.summary()}"


def _shown(manifest: Manifest, name: str) -> int | None:
    """The position of the item whose array ``name`` ``zstore info`` shows: the first
    that has it with values (no axis of length 0), else the first that has it."""
    first = manifest.first_index(name)
    if first is None or manifest.shapes is None or name not in manifest.shapes:
        return first
    shapes = np.asarray(manifest.shapes[name])
    if shapes.ndim != 2 or not shapes.shape[1]:
        return first
    full = np.flatnonzero((shapes > 0).all(axis=1))
    return int(full[0]) if len(full) else first


def _first_attrs(url: str, storage_options: dict[str, Any] | None, manifest: Manifest) -> list[str]:
    """The names of the first item's attributes (a speaker, a transcript), read as
    ``WindowDataset.item_attrs`` reads them, with no cache; none for an empty store, or
    where the item cannot be read (``info`` still describes a damaged store)."""
    if not manifest.items:
        return []
    from zstore.read import WindowReader

    try:
        reader = WindowReader(url, cache=None, storage_options=storage_options)
        return list(reader.open().item_attrs(0))
    except (ZstoreError, OSError, ValueError, KeyError):
        return []


def store_info(url: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Items, arrays (rate, shape, chunking), total duration, bytes and codec of a store."""
    manifest, metas = read_manifest(url, storage_options, history=True)
    arrays: dict[str, dict[str, Any]] = {}
    for name, a in manifest.arrays.items():
        entry: dict[str, Any] = {
            "rate": a.rate,
            "time_axis": a.time_axis,
            "inferred": a.inferred,
            "note": a.note,
            "dimension_names": list(a.dims) if a.dims else None,
            "values": a.values,
            "precision": a.precision.header() if a.precision else None,
        }
        have = manifest.items_with(name)
        entry["items_with"] = len(manifest.items) if have is None else len(have)
        first = _shown(manifest, name)
        in_pack = manifest.packed(first, name) if first is not None else None
        in_record = in_pack is not None and in_pack[1] < 0  # stored whole, in its record
        array_meta = (
            None
            if in_record
            else packed_meta(in_pack[0], name, a, manifest.codec, manifest.chunk_seconds)
            if in_pack is not None
            else metas.at(first, name)
            if first is not None
            else None
        )
        if array_meta:
            layout = parse_array_meta(name, array_meta, a.time_axis)
            first_shape = list(layout.shape)
            if in_pack is not None and manifest.shapes is not None:  # the item's, not its pack's
                first_shape = [int(x) for x in manifest.shapes[name][first]]
            entry.update(
                shape_of_first_item=first_shape,
                dtype=str(layout.dtype),
                chunk=list(layout.chunk_shape),
                shard_length=layout.shard,
                codecs=[c["name"] for c in layout.codecs],
            )
        elif first is not None and manifest.shapes is not None and name in manifest.shapes:
            # written through zarr's API (e.g. complex values), or kept in the records
            # of packed items: no chunking to derive
            entry.update(
                shape_of_first_item=[int(x) for x in manifest.shapes[name][first]],
                dtype=str(np.dtype(a.dtype)) if a.dtype else "?",
            )
        if in_record:
            entry["in_records"] = True
        cast = manifest.extra.get("dtypes", {}).get(name)
        if cast:  # the store keeps it as this dtype (--dtype), whatever the sources'
            entry["cast_to"] = cast
        if first is not None and first != manifest.first_index(name):
            entry["shown_item"] = manifest.items[first]
        if a.rate:
            lengths = np.asarray(manifest.lengths[name], dtype=np.int64)
            lengths = lengths[lengths >= 0]
            entry["seconds_total"] = round(int(lengths.sum()) / a.rate, 3)
            entry["seconds_min_max"] = (
                [round(int(lengths.min()) / a.rate, 3), round(int(lengths.max()) / a.rate, 3)]
                if len(lengths)
                else []
            )
        arrays[name] = entry
    nbytes = int(manifest.extra.get("store_bytes", 0))
    info = {
        "store": url,
        "store_id": manifest.store_id,
        "items": len(manifest.items),
        "codec": manifest.codec,
        "chunk_seconds": manifest.chunk_seconds,
        "store_bytes": nbytes,
        "arrays": arrays,
    }
    objects = stored_objects(manifest)
    packed = manifest.placement.packed_count() if manifest.placement is not None else 0
    info.update(
        packed_items=packed,
        pack_groups=len(manifest.packs),
        pack_seconds=manifest.extra.get("pack_seconds"),
        objects=objects,
    )
    timed = [a for a in arrays.values() if a.get("rate")]
    seconds = max((a["seconds_total"] for a in timed), default=0.0)
    lines = [
        f"{url}  (store id {manifest.store_id})",
        f"items: {len(manifest.items)}, total {seconds / 3600:.2f} h, "
        f"{format_size(nbytes)}, codec {manifest.codec} + crc32c, "
        f"chunks of {manifest.chunk_seconds:g} s",
    ]
    sources = [str(x) for x in manifest.extra.get("sources", [])]
    appended = len(manifest.extra.get("appended", []))
    info["sources"], info["appended_sources"] = sources, appended
    if sources:  # stores made before the history was kept may have none
        shown = ", ".join(os.path.basename(x) for x in sources[:3])
        more = f", ... ({len(sources) - 3} more)" if len(sources) > 3 else ""
        lines.append(
            f"sources: {len(sources)} file(s) ({shown}{more})"
            + (f", {appended} of them appended" if appended else "")
        )
    found = (  # None: no checksums (the store was converted before the converter took them)
        copies(list(manifest.items), unpack_digests(manifest.extra[DIGESTS], len(manifest.items)))
        if DIGESTS in manifest.extra
        else None
    )
    info["copies"] = None if found is None else [list(pair) for pair in found]
    if found:
        lines.append(copies_text(found))
    made_of = manifest.extra.get("dataset_items")
    info["dataset_items"] = made_of
    if made_of:
        lines.append(f"items: the source's datasets, each the array '{made_of}' (--dataset-items)")
    info["subgroups"] = manifest.extra.get("subgroups", "items")
    if info["subgroups"] == "arrays":
        lines.append(
            "items: groups inside an item's group hold arrays of it, named "
            "<subgroup>.<dataset> (--subgroups arrays)"
        )
    per_item = objects / max(1, len(manifest.items))
    lines.append(
        f"packed: {packed} of {len(manifest.items)} items "
        f"(items of at most {manifest.extra.get('pack_seconds', 0):g} s, in "
        f"{len(manifest.packs)} pack group(s)); {objects} objects, "
        f"{per_item:.3f} objects per item"
        if packed
        else f"packed: none; {objects} objects, {per_item:.3f} objects per item"
    )
    for name, e in arrays.items():
        rate = (
            f"{e['rate']:g}/s" + (" (inferred)" if e["inferred"] else "")
            if e["rate"]
            else "no time axis"
        )
        shape = e.get("shape_of_first_item")
        where = (
            ""
            if e["items_with"] == len(manifest.items)
            else f", in {e['items_with']} of {len(manifest.items)} items"
        )
        which = (
            f"item '{e['shown_item']}' (the first with values)"
            if "shown_item" in e
            else "first item"
        )
        chunking = (
            ", in the packed items' batch records"
            if e.get("in_records")
            else f", chunk {e['chunk']}, shard {e['shard_length']} along time"
            if "chunk" in e
            else ""
        )
        dtype = e.get("dtype", "?") + (" (cast, --dtype)" if e.get("cast_to") else "")
        lines.append(f"  {name}: {rate}, {dtype}, {which} {shape}{chunking}{where}")
        if e["note"] and (e["inferred"] or not e["rate"]):
            lines.append(f"    {e['note']}")
        line = _values_line(manifest.arrays[name])
        if line:
            lines.append(f"    {line}")
    names = info["item_attrs"] = _first_attrs(url, storage_options, manifest)
    if names:
        lines.append(
            f"item attributes (of '{manifest.items[0]}'; ds.item_attrs, attrs=): "
            + ", ".join(names)
        )
    skipped = list(manifest.extra.get("skipped", []))
    info["skipped"] = skipped
    if skipped:
        lines.append("left out of the sources:")  # a line per kind (convert/_skipped.py)
        lines += [f"  {s}" for s in skipped[:10]]
        if len(skipped) > 10:
            lines.append(f"  ... and {len(skipped) - 10} more lines (zstore info --json)")
    info["text"] = "\n".join(lines)
    return info
