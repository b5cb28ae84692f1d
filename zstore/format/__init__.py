"""The store format: what ``zstore convert`` writes and every reader relies on.

Holds the layout of items and arrays (chunk and shard geometry, the manifest header),
the item table, reading and publishing a manifest, size totals, the Zarr objects the
converter encodes itself (bit-identical to zarr-python's), chunk decoding, and HDF5
attributes as strict JSON.

May import: the shared leaves (:mod:`zstore.errors`, :mod:`zstore.units`,
:mod:`zstore.urls`, :mod:`zstore.origin`), numpy, zarr's codecs.  Never the cache, the
read path, training or torch: a reader and the converter both stand on it.
"""

from zstore.format.layout import ArrayInfo, ArrayLayout, Manifest, Span, geometry, parse_array_meta
from zstore.format.manifest import ArrayMetas, publish, read_manifest, upgrade

__all__ = [
    "ArrayInfo",
    "ArrayLayout",
    "ArrayMetas",
    "Manifest",
    "Span",
    "geometry",
    "parse_array_meta",
    "publish",
    "read_manifest",
    "upgrade",
]
