"""Streamed (non-temporal) copies into batch buffers: the same values as numpy's copy,
whatever the alignment, shape or strides; and WindowLoader's batches with and without
the extension."""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data import DataLoader

import zstore
import zstore.read.streamcopy as sc

stream = pytest.importorskip("zstore.read._stream", reason="the C extension was not built")


@pytest.fixture(params=["sse2", "avx512"], autouse=True)
def stores(request):
    """Every test runs with each kind of store the CPU has."""
    before = stream.stores()
    if before == "memcpy":
        pytest.skip("no streamed stores on this CPU (copies are memcpy)")
    try:
        stream.use(request.param)
    except ValueError:
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    stream.use(before)


@pytest.mark.parametrize(
    "nbytes", [0, 1, 15, 63, 64, 65, 4095, 4 * 4096, 4 * 4096 + 77, (1 << 20) + 3]
)
@pytest.mark.parametrize("shift", [0, 1, 8, 63])
def test_any_length_and_alignment(nbytes, shift):
    rng = np.random.default_rng(nbytes + shift)
    src_base = rng.integers(0, 256, nbytes + 128, dtype=np.uint8)
    dst_base = np.zeros(nbytes + 128, dtype=np.uint8)
    src = src_base[(shift * 7) % 64 :][:nbytes]
    dst = dst_base[shift:][:nbytes]
    stream.stream_copy(dst, src)
    assert np.array_equal(dst, src)
    assert not dst_base[:shift].any() and not dst_base[shift + nbytes :].any()  # nothing else


@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.float64])
def test_windows_out_of_strided_shards(dtype):
    rng = np.random.default_rng(1)
    shard = rng.standard_normal((8, 50_000)).astype(dtype)
    batch = np.zeros((4, 8, 20_001), dtype=dtype)
    for b, start in enumerate((0, 3, 12_345, 29_999)):
        stream.stream_copy(batch[b], shard[:, start : start + 20_001])
        assert np.array_equal(batch[b], shard[:, start : start + 20_001])
    cube = rng.standard_normal((3, 5, 7, 1000)).astype(dtype)
    out = np.zeros((3, 5, 7, 400), dtype=dtype)
    stream.stream_copy(out, cube[..., 17:417])
    assert np.array_equal(out, cube[..., 17:417])


def test_mismatches_are_refused():
    a = np.zeros((4, 100), np.float32)
    with pytest.raises(ValueError, match="shape"):
        stream.stream_copy(a, np.zeros((4, 99), np.float32))
    with pytest.raises(ValueError, match="item size"):
        stream.stream_copy(a, np.zeros((4, 100), np.float64))
    with pytest.raises(ValueError, match="contiguous"):
        stream.stream_copy(a, np.zeros((4, 200), np.float32)[:, ::2])
    readonly = np.zeros((4, 100), np.float32)
    readonly.setflags(write=False)
    with pytest.raises((BufferError, TypeError, ValueError)):
        stream.stream_copy(readonly, a)


def test_copy_streamed_takes_every_layout():
    """Long rows go through the extension; short rows, non-contiguous rows and object
    arrays are copied by numpy; the values are the same either way."""
    rng = np.random.default_rng(2)
    calls = []
    real = sc._stream_copy

    def counting(dst, src):
        calls.append(dst.shape)
        real(dst, src)

    cases = [
        (rng.standard_normal((8, 40_000)).astype(np.float32), np.s_[:, 100:20_100]),
        (rng.standard_normal((300_000, 3)).astype(np.float32), np.s_[5:100_005]),
        (rng.standard_normal((8, 40_000)).astype(np.float32), np.s_[:, 3:803]),
        (rng.standard_normal((8, 40_000)).astype(np.float32), np.s_[:, 1:40_000:2]),
    ]
    sc._stream_copy = counting
    try:
        for arr, window in cases:
            src = arr[window]
            dst = np.zeros(src.shape, src.dtype)
            sc.copy_streamed(dst, src)
            assert np.array_equal(dst, src)
        objs = np.array([{"a": 1}] * 5000, dtype=object)
        out = np.empty(5000, dtype=object)
        sc.copy_streamed(out, objs)
        assert out[0] == {"a": 1}
    finally:
        sc._stream_copy = real
    assert calls == [(8, 20_000), (300_000,)]  # long rows, and a contiguous block


@pytest.mark.parametrize("streamed", [True, False])
def test_loader_batches_with_and_without_the_extension(small_store, cache, monkeypatch, streamed):
    if not streamed:
        monkeypatch.setattr(sc, "_stream_copy", None)
    assert sc.streaming() is streamed
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=cache, seed=5)
    got = list(zstore.WindowLoader(ds, 3, threads=2))
    want = list(DataLoader(ds, batch_size=3))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for key in ("wav", "act", "length", "start"):
            assert np.array_equal(a[key].numpy(), b[key].numpy()), key


def _expected(dsts, srcs, parts, pads, axis):
    """What gather writes, slice by slice with numpy."""
    out = [d.copy() for d in dsts]
    head = (slice(None),) * axis
    for d, s, lo, n, at in parts:
        out[d][(*head, slice(at, at + n))] = srcs[s][(*head, slice(lo, lo + n))]
    for d, at in pads:
        out[d][(*head, slice(at, None))] = 0
    return out


@pytest.mark.parametrize(
    ("src_shape", "dst_shape", "axis"),
    [
        ((2, 3000), (2, 1600), 1),  # (speakers, frames): rows shorter than a stream
        ((1, 90_000), (1, 16_000), 1),  # mono 1 s windows: streamed rows
        ((6000, 3), (1600, 3), 0),  # time first: the block is one contiguous run
        ((3, 4, 9000), (3, 4, 5000), 2),
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.float64])
@pytest.mark.parametrize("how", ["streamed", "cached", "numpy"])
def test_gather_copies_what_numpy_copies(src_shape, dst_shape, axis, dtype, how, monkeypatch):
    """Spans of several sources into several slots, some in two parts (an item that ends
    in the next shard), some padded with zeros, into slots of one batch buffer and into
    slots whose leading axes are strided; with the extension and without it."""
    if how == "numpy":  # the extension not built
        monkeypatch.setattr(sc, "_gather", None)
    rng = np.random.default_rng(3)
    wide = [rng.standard_normal((*src_shape[:axis], src_shape[axis] * 2, *src_shape[axis + 1 :]))]
    srcs = [rng.standard_normal(src_shape).astype(dtype) for _ in range(3)]
    srcs.append(wide[0].astype(dtype)[(slice(None),) * axis + (slice(7, 7 + src_shape[axis]),)])
    batch = rng.standard_normal((4, *dst_shape)).astype(dtype)  # stale values to overwrite
    dsts = [batch[k] for k in range(4)]
    t = dst_shape[axis]
    parts = np.array(
        [
            (0, 0, 5, t, 0),  # a whole slot
            (1, 1, src_shape[axis] - 100, 100, 0),  # the end of one shard ...
            (1, 2, 0, t // 2, 100),  # ... then the next one
            (2, 3, 11, t // 3, 0),  # a strided source
            (3, 0, 0, 0, 0),  # an item of no samples
        ],
        dtype=np.int64,
    )
    pads = np.array([(1, 100 + t // 2), (2, t // 3), (3, 0)], dtype=np.int64)
    want = _expected(dsts, srcs, parts.tolist(), pads.tolist(), axis)
    sc.gather(dsts, srcs, parts, pads, axis, stream=how == "streamed")
    for got, expected in zip(dsts, want):
        assert np.array_equal(got, expected)
    assert not batch[3].any()


def test_gather_refuses_a_bad_row_before_writing_anything():
    src = np.arange(100, dtype=np.float32).reshape(2, 50)
    dst = np.full((2, 30), 7, dtype=np.float32)
    good = (0, 0, 0, 10, 0)

    def refused(rows, pads=(), srcs=(src,), match="outside"):
        table = np.array(rows, dtype=np.int64).reshape(-1, 5)
        zeros = np.array(pads, dtype=np.int64).reshape(-1, 2)
        with pytest.raises(ValueError, match=match):
            stream.gather([dst], list(srcs), table, zeros, 1, 1 << 14)
        assert (dst == 7).all()  # the good row before the bad one was not written

    refused([good, (0, 0, 45, 10, 0)])  # past the source's end
    refused([good, (0, 0, 0, 10, 25)])  # past the slot's end
    refused([good, (0, 0, -1, 10, 0)])
    refused([good, (0, 1, 0, 10, 0)], match="not there")
    refused([good, (1, 0, 0, 10, 0)], match="not there")
    refused([good], pads=[(0, 31)], match="pad")
    refused([good], srcs=[src.astype(np.float64)], match="dtype")
    refused([good], srcs=[src.astype(np.int32)], match="dtype")  # same item size
    refused([good], srcs=[np.zeros((3, 50), np.float32)], match="shape")
    refused([good], srcs=[np.zeros((100, 2), np.float32).T], match="contiguous")
    with pytest.raises(ValueError, match="int64"):
        stream.gather([dst], [src], np.zeros((1, 5), np.int32), np.zeros((0, 2), np.int64), 1, 0)
    with pytest.raises(ValueError, match="axis"):
        stream.gather([dst], [src], np.array([good], np.int64), np.zeros((0, 2), np.int64), 2, 0)
