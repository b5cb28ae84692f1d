"""Decoding chunks as the reader does (``zstore.format.decode``): python-blosc where it is
installed (AVX2 bitshuffle), numcodecs otherwise; the same values either way, and bytes
blosc cannot read are an IntegrityError that names the chunk, never data."""

from __future__ import annotations

import threading

import numcodecs
import numpy as np
import pytest
from crc32c import crc32c

import zstore.format.decode as decode
from zstore.errors import IntegrityError
from zstore.format import parse_array_meta
from zstore.format.objects import array_meta

SHAPES = {"float32": (4, 3000), "int16": (2, 5000), "float64": (3, 700), "bool": (5, 900)}


def values(dtype: str) -> np.ndarray:
    """int16-valued audio, true float, int16 samples and labels."""
    rng = np.random.default_rng(7)
    shape = SHAPES[dtype]
    if dtype == "float32":
        return (np.cumsum(rng.integers(-300, 300, shape), axis=1) / 32768).astype(np.float32)
    if dtype == "int16":
        return rng.integers(-32768, 32767, shape, dtype=np.int16)
    if dtype == "float64":
        return rng.standard_normal(shape)
    return rng.random(shape) > 0.7


def layout_of(x: np.ndarray, codec: str = "lz4"):
    meta = array_meta(x.shape, x.dtype, x.shape, None, codec)
    return parse_array_meta("rec/wav", meta, -1)


def stored(x: np.ndarray, cname: str, shuffle: int) -> bytes:
    """A chunk as a store holds it: Blosc, then its crc32c."""
    data = numcodecs.Blosc(cname=cname, clevel=5, shuffle=shuffle).encode(x)
    return data + crc32c(data).to_bytes(4, "little")


@pytest.fixture(params=["python-blosc", "numcodecs"])
def decoder(request, monkeypatch):
    """Each test runs with python-blosc decoding, and with numcodecs (as where the
    ``blosc`` package is not installed)."""
    if request.param == "python-blosc":
        assert decode._blosc is not None  # a dependency: installed with zstore
    else:
        monkeypatch.setattr(decode, "_blosc", None)
        monkeypatch.setattr(decode, "_BLOSC_ERRORS", (RuntimeError, ValueError))
    return request.param


@pytest.mark.parametrize("dtype", sorted(SHAPES))
@pytest.mark.parametrize("cname", ["lz4", "zstd"])
@pytest.mark.parametrize("shuffle", [0, 1, 2])
def test_every_codec_and_shuffle_decodes_to_the_values_written(decoder, dtype, cname, shuffle):
    x = values(dtype)
    layout = layout_of(x)
    data = stored(x, cname, shuffle)
    scratch = np.full(x.nbytes + 64, 0xAB, dtype=np.uint8)  # larger than the chunk
    into = decode.decode_chunk(layout, data, "rec/wav/c/0/0", scratch)
    np.testing.assert_array_equal(into, x)
    assert (scratch[x.nbytes :] == 0xAB).all()  # nothing written past the chunk
    np.testing.assert_array_equal(decode.decode_chunk(layout, data, "rec/wav/c/0/0"), x)


def test_a_chunk_written_by_the_converter_decodes_the_same_both_ways(decoder):
    from zstore.format.objects import _ChunkEncoder

    x = values("float32")
    data = _ChunkEncoder("lz4", x.dtype)(x)
    got = decode.decode_chunk(layout_of(x), data, "w", np.empty(x.nbytes, dtype=np.uint8))
    np.testing.assert_array_equal(got, x)


def test_bytes_blosc_cannot_read_are_an_integrity_error_naming_the_chunk(decoder):
    """Bytes whose crc32c matches (a store written with a bad Blosc build, or a crc
    collision) but that blosc cannot decode."""
    x = values("float32")
    good = numcodecs.Blosc(cname="lz4", clevel=5, shuffle=2).encode(x)
    for bad in (
        good[:16] + bytes(len(good) - 16),  # blocks zeroed
        good[:-40],  # cut short: the header's sizes no longer match
        bytes(16) + good[16:],  # no header
    ):
        data = bad + crc32c(bad).to_bytes(4, "little")
        for out in (np.empty(x.nbytes, dtype=np.uint8), None):
            with pytest.raises(IntegrityError, match="rec/wav/c/0/3"):
                decode.decode_chunk(layout_of(x), data, "rec/wav/c/0/3", out)


def test_a_buffer_smaller_than_the_chunk_is_refused_before_decoding(decoder):
    x = values("float32")
    small = np.full(x.nbytes - 4, 7, dtype=np.uint8)
    with pytest.raises(ValueError, match="bytes for a chunk of"):
        decode.decode_chunk(layout_of(x), stored(x, "lz4", 2), "w", small)
    assert (small == 7).all()


def test_threads_decode_side_by_side_with_the_same_values(decoder):
    """zstore's copy and fill threads decode at once (python-blosc releases the GIL
    and decodes with one thread per call)."""
    chunks = [values("float32") * (i + 1) for i in range(8)]
    layout = layout_of(chunks[0])
    data = [stored(x, "lz4", 2) for x in chunks]
    start = threading.Barrier(4, timeout=60)
    wrong: list[int] = []

    def work() -> None:
        scratch = np.empty(chunks[0].nbytes, dtype=np.uint8)
        start.wait()
        for _ in range(25):
            for i, d in enumerate(data):
                if not np.array_equal(decode.decode_chunk(layout, d, "w", scratch), chunks[i]):
                    wrong.append(i)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not wrong
