"""Copies into batch buffers that the training step reads only once the batch is full.

Such a copy gains nothing from leaving the destination in the CPU's cache: by the time
the step reads a 16-window batch (~80 MB of audio) its first windows have long left
it.  Non-temporal ("streamed") stores write whole cache lines straight to memory
without reading them first; measured here, a 5.1 MB window went from ~710 us (numpy's
copy) to ~410 us.  The stores come from the small C extension ``zstore._stream``,
built when zstore is installed; where it could not be built (no C compiler), windows
are copied with numpy, with the same values.  A batch of short windows is copied by
:func:`gather`, one call per field, from a table of spans.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

try:
    from zstore.read._stream import stream_copy as _stream_copy
except ImportError:  # not built: numpy's copy
    _stream_copy = None
try:
    from zstore.read._stream import gather as _gather
except ImportError:  # not built, or built before gather
    _gather = None
try:
    from zstore.read._stream import narrow as _narrow
    from zstore.read._stream import widen as _widen
except ImportError:  # not built, or built before narrow and widen
    _narrow = _widen = None

#: int16 samples to the float values they stand for (exact: a power of two)
SAMPLE = 2.0**-15

STREAM_ROW_BYTES = 16 * 1024  # shorter contiguous runs are copied the usual way


def streaming() -> bool:
    """Whether batch copies use streamed stores (the extension is built)."""
    return _stream_copy is not None


def gather(
    dsts: Sequence[np.ndarray],
    srcs: Sequence[np.ndarray],
    parts: np.ndarray,
    pads: np.ndarray,
    axis: int,
    *,
    stream: bool = True,
) -> None:
    """Many spans along ``axis`` at once (a batch of short windows): for each row ``(d,
    s, lo, n, at)`` of the int64 table ``parts``, ``dsts[d][..., at:at+n, ...] =
    srcs[s][..., lo:lo+n, ...]``; for each row ``(d, at)`` of ``pads``, zeros in
    ``dsts[d]`` from ``at`` to the end of ``axis``.  Each dst and its srcs have one dtype
    (or int16 samples into a float dst, widened as :func:`widen` does) and the same
    shape off ``axis``, and the last axis of each is contiguous.  With the
    extension it is one call, every row checked before anything is written (ValueError);
    measured on 1 s windows of two fields, ~5 us a window in all against ~10 with a numpy
    slice and copy per row.  ``stream``: long rows bypass the CPU's cache.  Without the
    extension numpy copies each row, with the same values."""
    if _gather is not None and _stream_copy is not None:
        _gather(dsts, srcs, parts, pads, axis, STREAM_ROW_BYTES if stream else 1 << 62)
        return
    head = (slice(None),) * axis
    for d, s, lo, n, at in parts.tolist():
        copy_values(dsts[d][(*head, slice(at, at + n))], srcs[s][(*head, slice(lo, lo + n))])
    for d, at in pads.tolist():
        dsts[d][(*head, slice(at, None))] = 0


def copy_streamed(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` (same shape and dtype), streamed when the runs are long."""
    if (
        _stream_copy is not None
        and dst.shape == src.shape
        and dst.dtype == src.dtype
        and dst.ndim > 0
        and not dst.dtype.hasobject
    ):
        if dst.flags.c_contiguous and src.flags.c_contiguous:
            if dst.nbytes >= STREAM_ROW_BYTES:
                _stream_copy(dst.reshape(-1), src.reshape(-1))
                return
        elif (
            dst.strides[-1] == src.strides[-1] == dst.itemsize
            and dst.shape[-1] * dst.itemsize >= STREAM_ROW_BYTES
        ):
            _stream_copy(dst, src)
            return
    dst[...] = src


def copy_values(dst: np.ndarray, src: np.ndarray, *, stream: bool = False) -> None:
    """``dst[...] = src`` (same shape), where a RAM-tier shard of int16 samples in
    ``src`` is widened into the float ``dst`` (:func:`widen`); ``stream``: long rows
    bypass the CPU's cache (:func:`copy_streamed`)."""
    if src.dtype != dst.dtype:
        widen(dst, src, stream=stream)
    elif stream:
        copy_streamed(dst, src)
    else:
        dst[...] = src


def _rows(dst: np.ndarray, src: np.ndarray) -> bool:
    """Whether the extension's narrow or widen takes ``dst`` and ``src`` (same shape,
    the last axis contiguous); its dtype checks raise ValueError."""
    return (
        dst.shape == src.shape
        and dst.ndim > 0
        and dst.strides[-1] == dst.itemsize
        and src.strides[-1] == src.itemsize
    )


def narrow(dst: np.ndarray, src: np.ndarray) -> bool:
    """``dst[...] = src * 32768`` for a float ``src`` of int16 samples (``x / 32768``)
    into an int16 ``dst`` of the same shape; True when every value is exactly a sample,
    so that :func:`widen` gives ``src`` back bit for bit.  False where one is not (NaN,
    inf, -0.0, a fraction of a sample, or outside [-32768, 32767] samples): ``dst`` is
    then unfinished and must not be used.  The extension does it in one pass (~the time
    of a copy); numpy in three."""
    if _narrow is not None and _rows(dst, src):
        return bool(_narrow(dst, src))
    if src.dtype.kind != "f" or dst.dtype != np.int16:
        raise ValueError(f"narrow: {src.dtype} into {dst.dtype}; float into int16 only")
    wide = src * src.dtype.type(32768)
    inside = (wide >= -32768) & (wide <= 32767)  # False for NaN
    if not inside.all():
        return False
    np.copyto(dst, wide, casting="unsafe")
    back = dst * src.dtype.type(SAMPLE)
    bits = np.dtype(f"u{src.dtype.itemsize}")
    return bool(np.array_equal(back.view(bits), src.view(bits)))  # -0.0 differs too


def widen(dst: np.ndarray, src: np.ndarray, *, stream: bool = False) -> None:
    """``dst[...] = src * 2**-15``: int16 samples into the float values they stand for
    (exact); ``stream``: long rows bypass the CPU's cache (a batch slot read later).
    Reading half the bytes of a float copy, measured as fast as a streamed float copy
    with the extension; numpy's multiply was ~20% slower in warm epochs."""
    if _widen is not None and _rows(dst, src):
        _widen(dst, src, STREAM_ROW_BYTES if stream else 1 << 62)
        return
    np.multiply(src, dst.dtype.type(SAMPLE), out=dst)
