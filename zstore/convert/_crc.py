"""Combining CRCs: the CRC of ``A + B`` from the CRCs of ``A`` and ``B`` and the length
of ``B``, without their bytes (zlib's ``crc32_combine``, by its polynomial
arithmetic), for CRC-32 (zlib's) and CRC-32C (Castagnoli).

An item's checksum (:func:`zstore.convert._copies.item_digest`) runs over each array's
values in C order.  An array converted in blocks along time (:mod:`zstore.convert._blocks`)
arrives as a piece of every row at a time, so each row is checksummed as it comes and
the rows are combined at the end: the checksum is the one the whole array would give.
"""

from __future__ import annotations

from functools import lru_cache

#: the reflected polynomials
CRC32 = 0xEDB88320
CRC32C = 0x82F63B78
_TOP = 1 << 31  # x^0, reflected


def _multiply(a: int, b: int, poly: int) -> int:
    """``a`` times ``b`` modulo the polynomial (reflected bit order)."""
    product = 0
    m = _TOP
    while m:
        if a & m:
            product ^= b
        b = (b >> 1) ^ poly if b & 1 else b >> 1
        m >>= 1
    return product


@lru_cache(maxsize=None)
def _squares(poly: int) -> tuple[int, ...]:
    """x^(2^k) modulo the polynomial, k = 0..63."""
    out = [_TOP >> 1]  # x^1
    for _ in range(63):
        out.append(_multiply(out[-1], out[-1], poly))
    return tuple(out)


def _x_to_8n(n: int, poly: int) -> int:
    """x^(8 n) modulo the polynomial: what ``n`` bytes shift a CRC by."""
    squares = _squares(poly)
    p, k = _TOP, 3  # 8 = 2^3
    while n:
        if n & 1:
            p = _multiply(squares[k], p, poly)
        n >>= 1
        k += 1
    return p


def combine(crc_a: int, crc_b: int, len_b: int, poly: int) -> int:
    """The CRC of ``A + B`` given ``crc(A)``, ``crc(B)`` (each from 0, as
    ``zlib.crc32(x)`` and ``crc32c(x)`` give them) and ``len(B)``."""
    if not len_b:
        return crc_a
    return _multiply(_x_to_8n(len_b, poly), crc_a, poly) ^ crc_b
