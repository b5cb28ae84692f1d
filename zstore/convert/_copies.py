"""Items that hold the same values as another item: copies of one recording.

Corpora gather copies: a file copied under a second name (``a.h5`` beside
``a (copy).h5``), one recording kept in two groups, a dev set appended again under
another file name.  Converted, each copy is an item of its own, and training sees it
twice as often as the others, silently.  The converter takes a checksum of each item's
values as it writes them (:func:`item_digest`: 64 bits over every array's name, dtype,
shape and values, ~10 GB/s: 6-8% of a worker's time converting int16-valued audio at
~0.6 GB/s, measured with the checksum and without), keeps the checksums in the store's
history (``"digests"``, in the manifest's item order; an item written before this
existed has none), and names the items that hold another's values in a warning, the
summary and ``zstore info``.  It stores them all as they are: whether a copy belongs in
training is the user's call (``--exclude``, ``items=``).

Each item's checksum also goes into its completion mark (``zstore_digest``) or its
batch record (packed items), so a conversion resumed after a kill has the checksums of
the items written before it.
"""

from __future__ import annotations

import base64
import math
import zlib
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
from crc32c import crc32c

from zstore.convert._crc import CRC32, CRC32C, combine

__all__ = [
    "DIGESTS",
    "ArrayDigest",
    "UNKNOWN",
    "appended",
    "checked_digest",
    "copies",
    "copies_text",
    "item_digest",
    "pack_digests",
    "unpack_digests",
]


#: the history key of the items' checksums
DIGESTS = "digests"
#: an item with no checksum (written before the converter took them)
UNKNOWN = "0" * 16
#: The second half of a checksum (crc32) covers all of an array up to 512 KiB and one
#: 64 KiB block in 8 of a larger one; the first (crc32c) covers every byte.  Both
#: halves over every byte ran at 2.8 GB/s, a quarter of a worker's conversion time on
#: int16-valued audio; two items that differ only outside the sampled blocks of large
#: arrays are checked to 32 bits, not 64.
SAMPLE_BLOCK, SAMPLE_EVERY = 1 << 16, 8


def item_digest(
    arrays: Mapping[str, np.ndarray], parts: Mapping[str, ArrayDigest] | None = None
) -> str:
    """A checksum of an item's values, as 16 hex digits: its arrays in name order, each
    with its name, dtype (little-endian) and shape.  Equal values give equal checksums,
    whatever byte order or layout the source stored them in.  ``parts``: arrays
    checksummed block by block as they were converted (:class:`ArrayDigest`), which
    give the checksum their whole values would."""
    parts = parts or {}
    a = b = 0
    for name in sorted({*arrays, *parts}):
        if name in parts:
            pa, pa_len, pb, pb_len = parts[name].result()
            a, b = combine(a, pa, pa_len, CRC32C), combine(b, pb, pb_len, CRC32)
            continue
        data = np.asarray(arrays[name])
        shape = data.shape  # a scalar's: ascontiguousarray makes it 1-d
        data = np.ascontiguousarray(data, dtype=data.dtype.newbyteorder("<"))
        head = _head(name, data.dtype, shape)
        view = data.reshape(-1).view(np.uint8).data
        a, b = crc32c(view, crc32c(head, a)), zlib.crc32(head, b)
        for part in _sampled(view):
            b = zlib.crc32(part, b)
    return f"{a:08x}{b:08x}"


def _head(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    return f"{name}|{dtype.str}|{shape}|".encode()


class ArrayDigest:
    """The checksum :func:`item_digest` takes of one array, fed a block of its values
    along ``axis`` at a time (each block all of the other axes, in order of time).

    In C order a block is a piece of each row (a row: every value at one index of the
    axes before ``axis``), so each row's two CRCs are kept apart as its pieces come and
    joined at the end (:func:`zstore.convert._crc.combine`)."""

    def __init__(self, name: str, shape: tuple[int, ...], axis: int):
        self.name, self.shape = name, shape
        self.axis = axis % len(shape)
        self.rows = math.prod(shape[: self.axis])
        self.dtype: np.dtype | None = None
        self.a = [0] * self.rows
        self.b = [0] * self.rows
        self.b_len = [0] * self.rows

    def add(self, block: np.ndarray, start: int) -> None:
        """Values ``start`` to ``start + block.shape[axis]`` along the axis."""
        data = np.ascontiguousarray(block, dtype=block.dtype.newbyteorder("<"))
        if self.dtype is None:
            self.dtype = data.dtype
        elif data.dtype != self.dtype:
            raise ValueError(f"'{self.name}': a block of {data.dtype}, not {self.dtype}")
        step = math.prod(self.shape[self.axis + 1 :]) * data.dtype.itemsize
        row_nbytes = self.shape[self.axis] * step
        sampled_all = row_nbytes * self.rows <= SAMPLE_EVERY * SAMPLE_BLOCK
        pieces = data.reshape(self.rows, -1).view(np.uint8)
        for r in range(self.rows):
            piece = pieces[r].data
            self.a[r] = crc32c(piece, self.a[r])
            at = r * row_nbytes + start * step  # the piece's offset in the whole array
            for lo, hi in [(at, at + len(piece))] if sampled_all else _sampled_in(at, len(piece)):
                self.b[r] = zlib.crc32(piece[lo - at : hi - at], self.b[r])
                self.b_len[r] += hi - lo

    def result(self) -> tuple[int, int, int, int]:
        """(crc32c, its length, crc32, its length) of the array's name, dtype and shape
        followed by its values (the crc32 of the sampled values only), each from 0."""
        if self.dtype is None:
            raise ValueError(f"'{self.name}': no values were added")
        head = _head(self.name, self.dtype, self.shape)
        row_nbytes = math.prod(self.shape[self.axis :]) * self.dtype.itemsize
        a, b = crc32c(head), zlib.crc32(head)
        for r in range(self.rows):
            a = combine(a, self.a[r], row_nbytes, CRC32C)
            b = combine(b, self.b[r], self.b_len[r], CRC32)
        return a, len(head) + row_nbytes * self.rows, b, len(head) + sum(self.b_len)


def _sampled_in(at: int, n: int) -> Iterator[tuple[int, int]]:
    """The sampled byte ranges (:func:`_sampled`, of an array too large to take whole)
    within bytes ``at`` to ``at + n`` of the array."""
    run = SAMPLE_EVERY * SAMPLE_BLOCK
    for k in range(at // run, (at + n - 1) // run + 1):
        lo, hi = max(at, k * run), min(at + n, k * run + SAMPLE_BLOCK)
        if lo < hi:
            yield lo, hi


def _sampled(view: memoryview) -> Iterator[memoryview]:
    """All of a small array's bytes; of a larger one, one block in every
    :data:`SAMPLE_EVERY` (the first of each run)."""
    if len(view) <= SAMPLE_EVERY * SAMPLE_BLOCK:
        yield view
        return
    for at in range(0, len(view), SAMPLE_EVERY * SAMPLE_BLOCK):
        yield view[at : at + SAMPLE_BLOCK]


def checked_digest(value: object) -> str:
    """A checksum read back from a mark or a record: itself when it is one, else
    :data:`UNKNOWN` (written before the converter took them, or damaged)."""
    text = str(value) if value is not None else ""
    if len(text) == 16 and all(c in "0123456789abcdef" for c in text):
        return text
    return UNKNOWN


def pack_digests(digests: Sequence[str]) -> str:
    """Checksums (in item order) as the history keeps them: 8 bytes each, base64."""
    raw = b"".join(bytes.fromhex(d) for d in digests)
    return base64.b64encode(raw).decode("ascii")


def unpack_digests(text: object, n: int) -> list[str]:
    """The history's checksums of ``n`` items (:data:`UNKNOWN` for every item where the
    store has none, or they do not fit its items)."""
    try:
        raw = base64.b64decode(str(text), validate=True) if text else b""
    except ValueError:
        raw = b""
    if len(raw) != 8 * n:
        return [UNKNOWN] * n
    return [raw[8 * i : 8 * i + 8].hex() for i in range(n)]


def copies(
    names: Sequence[str], digests: Sequence[str], first_new: int = 0
) -> list[tuple[str, str]]:
    """(item, the earlier item it copies) for each item from ``first_new`` on whose
    checksum an earlier item has (items before ``first_new``: a store's own)."""
    seen: dict[str, str] = {}
    out: list[tuple[str, str]] = []
    for i, (name, d) in enumerate(zip(names, digests)):
        if d == UNKNOWN:
            continue
        if d in seen:
            if i >= first_new:
                out.append((name, seen[d]))
        else:
            seen[d] = name
    return out


def copies_text(found: Sequence[tuple[str, str]]) -> str:
    """What the summary and the warning say of ``found`` (see :func:`copies`)."""
    shown = ", ".join(f"'{a}' = '{b}'" for a, b in found[:3])
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    return (
        f"{len(found)} item(s) hold the same values as an earlier item "
        f"({shown}{more}): copies of one recording? "
        "Each is stored and read as an item of its own; leave the copies out with "
        "--exclude or items= if training should see them once"
    )


def appended(
    history: Mapping[str, object],
    old: Sequence[str],
    new: Sequence[str],
    written: Mapping[str, str],
) -> tuple[str, list[tuple[str, str]]]:
    """An append's checksums as the history keeps them (the store's ``old`` items', from
    its ``history``, then the ``new`` items', from ``written``), and the new items that
    copy an earlier one, old or new."""
    digests = unpack_digests(history.get(DIGESTS), len(old))
    digests += [written.get(name, UNKNOWN) for name in new]
    return pack_digests(digests), copies([*old, *new], digests, first_new=len(old))
