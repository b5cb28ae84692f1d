"""A destination that fills up while the converter writes: one error naming it, and the
same command, once there is room, finishes the store."""

from __future__ import annotations

import errno
import importlib

import numpy as np
import pytest
from conftest import write_h5

import zstore

objects_module = importlib.import_module("zstore.format.objects")


def _recordings(first: int, n: int, seconds: int) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for i in range(first, first + n):
        rng = np.random.default_rng(i)
        out[f"u{i}"] = {
            "wav": (rng.integers(-3000, 3000, (1, 16000 * seconds)) / 32768).astype(np.float32)
        }
    return out


def _fill_after(monkeypatch, puts: int) -> None:
    """The destination's disk is full after ``puts`` more writes (of one or more
    objects each): every write after them fails as a full disk does."""
    real = objects_module.ObjectWriter.put
    left = [puts]

    def put(self, objects, **kwargs):
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        left[0] -= 1
        return real(self, objects, **kwargs)

    monkeypatch.setattr(objects_module.ObjectWriter, "put", put)


def _same(store: str, want: dict) -> None:
    ds = zstore.WindowDataset(store, window_seconds=None, cache=False)
    got = {ds[i]["item"]: ds[i]["wav"].numpy() for i in range(len(ds))}
    assert sorted(got) == sorted(want)
    for name, arrays in want.items():
        np.testing.assert_array_equal(got[name], arrays["wav"])


@pytest.mark.parametrize("seconds", [3, 15])  # packed, and a group per item
def test_a_full_disk_is_one_error_and_the_same_command_finishes(tmp_path, monkeypatch, seconds):
    first, more = _recordings(0, 4, seconds), _recordings(4, 3, seconds)
    src, new = write_h5(tmp_path / "a.h5", first), write_h5(tmp_path / "b.h5", more)
    store = str(tmp_path / "s.zarr")
    options = {"rates": {"wav": 16000}, "workers": 1, "progress": False}
    _fill_after(monkeypatch, 4)
    with pytest.raises(zstore.DestinationError, match="no space left to write the store") as e:
        zstore.convert(src, store, **options)
    assert "No space left on device" in str(e.value) and "run the same command again" in str(
        e.value
    )
    monkeypatch.undo()  # room made
    assert not list((tmp_path / "s.zarr").rglob("*.partial"))
    zstore.convert(src, store, **options)
    _same(store, first)
    _fill_after(monkeypatch, 2)
    with pytest.raises(zstore.DestinationError, match="no space left"):
        zstore.append(new, store, workers=1, progress=False)
    monkeypatch.undo()
    _same(store, first)  # the store as it was: the append was not published
    zstore.append(new, store, workers=1, progress=False)
    _same(store, {**first, **more})
