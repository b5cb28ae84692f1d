"""``WindowDataset``: a map-style torch Dataset of random time windows.  Thin: no cache logic."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from zstore.cache import CacheConfig, as_cache_config
from zstore.errors import ConfigError, some_names
from zstore.read import WindowReader
from zstore.train._dataset_setup import DatasetSetup
from zstore.train._item_lists import select_items
from zstore.train._windows import WindowPlacement


def _whole(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be a whole number, got {value!r}")
    return int(value)


def _check_window(window_seconds: Any) -> float | None:
    if window_seconds is None:
        return None
    if (
        isinstance(window_seconds, (bool, np.bool_))
        or not isinstance(window_seconds, (int, float, np.integer, np.floating))
        or not math.isfinite(window_seconds)
        or window_seconds <= 0
    ):
        raise ConfigError(
            f"window_seconds must be a positive number of seconds (or None for "
            f"whole items), got {window_seconds!r}"
        )
    return float(window_seconds)


class WindowDataset(DatasetSetup, WindowPlacement, torch.utils.data.Dataset):
    """Item ``i`` is a random window of utterance ``i``, drawn from ``(seed, epoch, i)``.

    Args:
        url: the store (path or fsspec URL) written by ``zstore convert``.
        fields: arrays to read (default: the time arrays that every item with a time
            array has; items with none are left out, with a warning).  Non-time arrays
            are returned whole.
        window_seconds: window duration; ``None`` returns whole items.
        seed: the draw's seed.
        short: items shorter than the window: ``"pad"`` (zero-pad; ``length``
            says how much is real), ``"skip"`` (leave them out of ``len``) or
            ``"error"`` (raise now, naming them).
        cache: :class:`zstore.CacheConfig`; ``None`` uses the defaults and the
            ``ZSTORE_*`` environment, ``False`` reads the origin directly.
        storage_options: passed to fsspec (S3 endpoint, credentials, ...).
        transform: applied to each item's dict.
        windows_per_item: windows drawn from each item per epoch, each from
            ``(seed, epoch, item, j)``; ``len(ds)`` grows by that factor.
        missing: items that lack a field asked for: ``"error"`` (the default: one
            error naming them) or ``"skip"`` (leave them out, with a warning).
        items: the items to serve, in this order: a list of item names; a file of them
            (text with one name per line and ``#`` comments, a JSON list, or a pickled
            list or tuple, as HDF5 loaders keep their subsets: a pickle runs code when
            loaded, so pass only your own); or a callable ``(name, attrs) -> bool``
            given each item's HDF5 attributes.  Default: every item.
        attrs: names of item attributes (:meth:`item_attrs`: a speaker, a transcript)
            to add to each window's dict and, collated as torch's DataLoader would,
            to each :class:`zstore.WindowLoader` batch; an item that lacks one is an
            error naming it.

    ``ds[i]`` is a dict: one tensor per field (all cut at the same time span,
    the start on the coarsest field's grid), ``"item"`` (name), ``"start"``
    (seconds) and ``"length"`` (real frames of the coarsest field).  Call
    :meth:`set_epoch` before each epoch, as with ``DistributedSampler``.
    """

    def __init__(
        self,
        url: str,
        *,
        fields: Sequence[str] | None = None,
        window_seconds: float | None = 10.0,
        seed: int = 0,
        short: str = "pad",
        cache: CacheConfig | bool | None = None,
        storage_options: dict[str, Any] | None = None,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        origin_fs: Any = None,
        windows_per_item: int = 1,
        missing: str = "error",
        items: Sequence[str]
        | str
        | os.PathLike[str]
        | Callable[[str, dict[str, Any]], bool]
        | None = None,
        attrs: Sequence[str] | None = None,
    ):
        self.url = str(url)
        self.fields = list(fields) if fields is not None else None
        self.attrs = [attrs] if isinstance(attrs, str) else list(attrs or [])
        self.window_seconds = _check_window(window_seconds)
        self.seed = _whole("seed", seed)
        self.epoch = 0
        self.short = short
        self.transform = transform
        self.windows_per_item = _whole("windows_per_item", windows_per_item)
        if self.windows_per_item < 1:
            raise ConfigError(f"windows_per_item must be at least 1, got {windows_per_item}")
        self._plain_seen: tuple[int, bytearray] | None = None  # see _note_plain
        self._selected: list[str] | None = None
        if missing not in ("error", "skip"):
            raise ConfigError(f"missing must be 'error' or 'skip', got {missing!r}")
        self.missing = missing
        self._lacking_said = False
        self._untimed_said = False
        self._warned_epoch = False
        self.reader = WindowReader(
            self.url,
            cache=as_cache_config(cache),
            storage_options=storage_options,
            origin_fs=origin_fs,
            fields=self.fields,
        )
        if items is not None:
            self._selected = select_items(self.reader.open(), items, self.url)
        self._setup()
        taken = {*self._names, "item", "start", "length"} & set(self.attrs)
        if taken:
            raise ConfigError(
                f"{self.url}: attrs {sorted(taken)} would replace the window's own keys "
                "(its fields, item, start, length); read them with item_attrs instead"
            )
        if len(self._empty):
            step = (
                f" (not one step of '{self._coarse}' at {self._rates[self._coarse]:g}/s, "
                "the coarsest array read)"
                if self._coarse
                else ""
            )
            warnings.warn(
                f"{self.url}: {len(self._empty)} item(s) hold no samples{step} and are left "
                "out, not padded: "
                f"{some_names([self._items[int(i)] for i in self._empty[:5]], len(self._empty))}",
                stacklevel=2,
            )
        if len(self._short) and short != "error":
            what = "padded with zeros" if short == "pad" else "left out"
            warnings.warn(
                f"{self.url}: {len(self._short)} item(s) shorter than "
                f"{window_seconds} s are {what} (short={short!r})",
                stacklevel=2,
            )

    @property
    def short_items(self) -> list[str]:
        """Names of the items shorter than the window (padded, or left out)."""
        return [self._items[int(i)] for i in self._short]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in (
            "_lengths",
            "_items",
            "_index",
            "_short",
            "_field_lengths",
            "_plain_seen",
            "_attr_cache",
        ):
            state.pop(key, None)  # rebuilt from the manifest in the new process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._plain_seen = None
        self._setup()

    def __len__(self) -> int:
        return len(self._index) * self.windows_per_item

    def item_lengths(self) -> list[int]:
        """The length (frames of the coarsest field) of every item the dataset serves, in
        index order: index ``i`` reads item ``i // windows_per_item`` of this list."""
        index = self._index
        if isinstance(index, range):
            return np.asarray(self._lengths[index.start : index.stop]).tolist()
        return np.asarray(self._lengths[index]).tolist()

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until the shards this process is filling into the RAM tier behind its
        reads are in (a read never waits for them: it is served from its own chunks).
        Useful before timing warm reads, or before another process is expected to find
        them there; False if ``timeout`` seconds passed first."""
        return self.reader.settle(timeout)

    def set_epoch(self, epoch: int) -> None:
        """Move to another draw of windows (call it before each epoch)."""
        self.epoch = _whole("epoch", epoch)

    def __getitem__(self, i: int | tuple[int, int]) -> dict[str, Any]:
        w = self.window(i)
        name = self._items[w.item]
        arrays = self.reader.read(name, self._spans(w), w.item)
        coarse_rate = self._rates[self._coarse] if self._coarse else 1.0
        out: dict[str, Any] = {field: torch.from_numpy(arr) for field, arr in arrays.items()}
        out["item"] = name
        out["start"] = w.start / coarse_rate
        out["length"] = w.take
        if self.attrs:
            out.update(self.attrs_of(w.item))
        return self.transform(out) if self.transform is not None else out
