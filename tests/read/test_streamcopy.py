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
