"""The store format: what ``zstore convert`` writes and every reader relies on.

Holds the layout of items and arrays (chunk and shard geometry, the manifest header),
the item table, reading and publishing a manifest, size totals, the Zarr objects the
converter encodes itself (bit-identical to zarr-python's), chunk decoding, and HDF5
attributes as strict JSON.

May import: the shared leaves (:mod:`zstore.errors`, :mod:`zstore.units`,
:mod:`zstore.urls`, :mod:`zstore.origin`), numpy, zarr's codecs.  Never the cache, the
read path, training or torch: a reader and the converter both stand on it.
"""

from zstore.format.attrs import decode_attrs, hdf5_attrs, hdf5_attrs_of
from zstore.format.decode import EMPTY, decode_chunk, decode_index, fill_chunk, strip_crc
from zstore.format.layout import (
    DONE_ATTR,
    MANIFEST_ATTR,
    PROGRESS_ATTR,
    ArrayInfo,
    ArrayLayout,
    Manifest,
    Span,
    geometry,
    parse_array_meta,
    scale,
    step_nbytes,
)
from zstore.format.manifest import (
    VERIFIED,
    ArrayMetas,
    build,
    current_shapes,
    publish,
    read_manifest,
    read_root,
    shape_rows,
    upgrade,
    verified_tables,
)
from zstore.format.objects import (
    ObjectWriter,
    array_meta,
    data_type,
    dumps,
    encode_array,
    group_meta,
    handles,
)
from zstore.format.packs import (
    PACK_SECONDS,
    PACKED_ROOT,
    PackGroup,
    Placement,
    packed_geometry,
    packed_meta,
    shards_for,
    signature,
)
from zstore.format.precision import (
    PRECISION_ATTR,
    VALUE_KINDS,
    Precision,
    bits_for_snr,
    effective_bits,
    energies,
    parse_precision,
    round_mantissa,
    snr_db,
    value_kind,
    wider_kind,
    within_rounding,
)
from zstore.format.sizing import field_sizes, stored_objects

__all__ = [
    "PACK_SECONDS",
    "PACKED_ROOT",
    "PackGroup",
    "Placement",
    "packed_geometry",
    "packed_meta",
    "shards_for",
    "signature",
    "bits_for_snr",
    "effective_bits",
    "energies",
    "parse_precision",
    "Precision",
    "PRECISION_ATTR",
    "round_mantissa",
    "snr_db",
    "value_kind",
    "VALUE_KINDS",
    "wider_kind",
    "within_rounding",
    "array_meta",
    "ArrayInfo",
    "ArrayLayout",
    "ArrayMetas",
    "build",
    "current_shapes",
    "data_type",
    "decode_attrs",
    "decode_chunk",
    "decode_index",
    "DONE_ATTR",
    "dumps",
    "EMPTY",
    "encode_array",
    "field_sizes",
    "stored_objects",
    "fill_chunk",
    "geometry",
    "group_meta",
    "handles",
    "hdf5_attrs",
    "hdf5_attrs_of",
    "Manifest",
    "MANIFEST_ATTR",
    "ObjectWriter",
    "parse_array_meta",
    "PROGRESS_ATTR",
    "publish",
    "read_manifest",
    "read_root",
    "scale",
    "shape_rows",
    "Span",
    "step_nbytes",
    "strip_crc",
    "upgrade",
    "VERIFIED",
    "verified_tables",
]
