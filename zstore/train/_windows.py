"""Where each index of a :class:`zstore.train.dataset.WindowDataset` reads: its item, its
window (drawn from ``(seed, epoch, index)``), each field's span, and the item's
attributes (:class:`WindowPlacement`)."""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from zstore.format import Span, scale
from zstore.train._window_draw import Window, window_for

if TYPE_CHECKING:
    from zstore.read import WindowReader


#: items whose ``attrs`` a process keeps (a few hundred bytes each)
ATTR_CACHE = 4096


class WindowPlacement:
    """The part of :class:`zstore.train.dataset.WindowDataset` that places an index:
    which item and window it reads."""

    if TYPE_CHECKING:
        url: str
        seed: int
        epoch: int
        windows_per_item: int
        reader: WindowReader
        _index: Any
        _lengths: Any
        _items: Any
        _window: int | None
        _rates: dict[str, float]
        _coarse: str | None
        _rules: list[tuple[str, int | None, float | None]]
        _field_lengths: dict[str, Any]
        _warned_epoch: bool
        _plain_seen: tuple[int, bytearray] | None
        attrs: list[str]
        _attr_cache: OrderedDict[int, dict[str, Any]]

        def __len__(self) -> int: ...

    def window(self, i: int | tuple[int, int]) -> Window:
        """Where ``ds[i]`` lies: item index, start, real frames and padding (coarse grid).

        ``i`` is an index, or an ``(epoch, index)`` pair as zstore's samplers yield:
        the epoch then travels with the index and ``set_epoch`` is not needed.
        """
        if isinstance(i, tuple):
            epoch, i = i
        else:
            epoch = self.epoch
            self._note_plain(i)
        item, j = self._item_at(i)
        return window_for(item, int(self._lengths[item]), self._window, self.seed, epoch, j)

    def _item_at(self, i: int) -> tuple[int, int]:
        """(the item's position in the store's manifest, which of its windows) of index
        ``i``."""
        n = len(self)
        if not 0 <= i < n:  # a negative index is a caller's bug, never the last item
            raise IndexError(f"index {i} out of range for {n} windows (0 to {n - 1})")
        item_i, j = divmod(i, self.windows_per_item)
        return int(self._index[item_i]), j

    def item_attrs(self, key: int | tuple[int, int] | str) -> dict[str, Any]:
        """The attributes of an item's HDF5 group, as the converter kept them (a speaker,
        a gender, a transcript kept as an attribute): of the item that ``ds[key]`` reads
        (an index, or an ``(epoch, index)`` pair), or of the item named ``key``, as
        ``ds[i]["item"]`` and a :class:`zstore.WindowLoader` batch's ``"item"`` give
        it.  NaN and infinite values come back as floats; the converter's own marks are
        left out.  Read through the cache tiers on each call (a packed item's from its
        batch's record, which this process keeps)."""
        if isinstance(key, str):
            try:
                position = self.reader.open().manifest.position(key)
            except ValueError:
                like = f"items are named like {self._items[0]!r}; " if len(self._items) else ""
                raise KeyError(
                    f"{self.url}: no item is named {key!r} ({like}see zstore info)"
                ) from None
        else:
            position = self._item_at(key[1] if isinstance(key, tuple) else key)[0]
        return self.reader.item_attrs(position)

    def attrs_of(self, position: int) -> dict[str, Any]:
        """The attributes named by ``attrs`` of the item at ``position`` in the store's
        manifest (kept for the last :data:`ATTR_CACHE` items this process read: an
        item's attributes never change under a store's one version)."""
        cache: OrderedDict[int, dict[str, Any]] | None = getattr(self, "_attr_cache", None)
        if cache is None:
            cache = self._attr_cache = OrderedDict()
        found = cache.get(position)
        if found is None:
            found = self.reader.item_named_attrs(position, self.attrs)
            lacking = [k for k in self.attrs if k not in found]
            if lacking:
                have = self.reader.item_attrs(position)
                raise KeyError(
                    f"{self.url}: item {self._items[position]!r} has no attribute "
                    f"{lacking[0]!r} (attrs=); it has {sorted(have) or 'none'}"
                )
            cache[position] = found
            if len(cache) > ATTR_CACHE:
                cache.popitem(last=False)
        # a list is copied: a transform that changes one in place changes no later window
        return {k: copy.deepcopy(v) if isinstance(v, (list, dict)) else v for k, v in found.items()}

    def _note_plain(self, i: int) -> None:
        """In a DataLoader worker, say once if a plain index comes twice in one epoch:
        the window draw did not move (set_epoch in the main process does not reach
        persistent workers, and Lightning calls it on the sampler only)."""
        if self._warned_epoch or torch.utils.data.get_worker_info() is None:
            return
        seen = self._plain_seen
        if seen is None or seen[0] != self.epoch:
            seen = self._plain_seen = (self.epoch, bytearray(len(self) // 8 + 1))
        bits, i = seen[1], i % len(self)
        if bits[i >> 3] & (1 << (i & 7)):
            self._warned_epoch = True
            warnings.warn(
                f"{self.url}: window {i} was asked for twice in epoch {self.epoch}; if this "
                "is a new epoch, its windows are the last epoch's (set_epoch did not reach "
                "this process: persistent_workers=True, Lightning). Use "
                "zstore.WindowSampler or zstore.NodeSampler, whose indices carry the epoch",
                stacklevel=3,
            )
        bits[i >> 3] |= 1 << (i & 7)

    def locate(self, i: int | tuple[int, int]) -> tuple[str, dict[str, Span | None], float, int]:
        """What ``ds[i]`` reads: (item name, span per field, start in seconds, real
        frames of the coarsest field)."""
        name, spans, start, take, _ = self.placed(i)
        return name, spans, start, take

    def placed(
        self, i: int | tuple[int, int]
    ) -> tuple[str, dict[str, Span | None], float, int, int]:
        """:meth:`locate`, and the item's position in the store's manifest."""
        w = self.window(i)
        coarse_rate = self._rates[self._coarse] if self._coarse else 1.0
        return self._items[w.item], self._spans(w), w.start / coarse_rate, w.take, w.item

    def _spans(self, w: Window) -> dict[str, Span | None]:
        spans: dict[str, Span | None] = {}
        coarse_rate = self._rates.get(self._coarse, 1.0) if self._coarse else 1.0
        for name, whole, ratio in self._rules:
            if ratio is None or self._window is None:  # whole arrays
                spans[name] = None
            elif whole is not None:  # exact; ends within the field (see _rules)
                start, stop = w.start * whole, (w.start + w.take) * whole
                spans[name] = Span(start, stop, (w.take + w.pad) * whole - (stop - start))
            else:
                rate = self._rates[name]
                start = scale(w.start, coarse_rate, rate)
                stop = scale(w.start + w.take, coarse_rate, rate)
                total = scale(w.take + w.pad, coarse_rate, rate)
                stop = min(stop, int(self._field_lengths[name][w.item]))  # rounding
                spans[name] = Span(start, stop, total - (stop - start))
        return spans
