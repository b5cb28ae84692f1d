"""Long arrays converted a block of whole shards at a time.

A worker once read each array whole, then held its cast, its rounding and its encoded
objects beside it: 1.5x a long recording's bytes in memory (2.8 GB for an hour of 8 mics
at 16 kHz in float32), 3x with ``--precision`` and ``--verify``, so a meeting corpus's
sessions (hours, tens of channels) ended in the out-of-memory killer, and the default of
a worker per core multiplied it.  An array of more than :data:`BLOCK_BYTES` along time
is now read, cast, rounded, encoded and written in blocks of whole shards
(``encode_array(first=)``), its checksum taken as the blocks come
(:class:`zstore.convert._copies.ArrayDigest`), and ``--verify`` compares it the same
way: a worker holds a few blocks, whatever the recording's length.  The stored objects
are those the whole array gives (every block but the last is whole shards).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import h5py

from zstore.format import ArrayInfo, geometry

#: source bytes of an array read in one piece; longer time arrays go in blocks of
#: whole shards of about this size (at least one shard, and at least one of the
#: source's own compressed HDF5 chunks along time, so none is decompressed more than
#: twice; HDF5 reads part of an uncompressed chunk straight from the file)
BLOCK_BYTES = 64 << 20


class Block(NamedTuple):
    """A block of an array: its selection of the dataset (``()``: all of it), its
    ``start`` along time, and the index along time of its ``first`` shard."""

    select: tuple[slice, ...]
    start: int
    first: int


WHOLE = Block((), 0, 0)


def blocks(
    ds: Any, shape: tuple[int, ...], info: ArrayInfo, chunk_seconds: float, itemsize: int
) -> list[Block]:
    """The blocks to convert array ``ds`` (of ``shape``; ``itemsize`` as stored) in:
    one, :data:`WHOLE`, unless it is a time array of a plain HDF5 dataset of more than
    :data:`BLOCK_BYTES`."""
    axis = info.time_axis
    if axis is None or not shape or not isinstance(ds, h5py.Dataset):
        return [WHOLE]
    axis %= len(shape)
    length = shape[axis]
    nbytes = math.prod(shape) * max(itemsize, ds.dtype.itemsize)
    if nbytes <= BLOCK_BYTES or not length:
        return [WHOLE]
    _, shards = geometry(shape, info.rate, axis, chunk_seconds, itemsize)
    shard = shards[axis] if shards is not None else length
    step = nbytes // length  # bytes of one step along time
    per = max(1, BLOCK_BYTES // (shard * step)) * shard
    if ds.chunks is not None and ds.id.get_create_plist().get_nfilters():
        per = max(per, -(-ds.chunks[axis] // shard) * shard)
    if per >= length:
        return [WHOLE]
    out = []
    for start in range(0, length, per):
        index = [slice(None)] * len(shape)
        index[axis] = slice(start, min(length, start + per))
        out.append(Block(tuple(index), start, start // shard))
    return out
