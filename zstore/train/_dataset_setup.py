"""Which items and windows a :class:`zstore.train.dataset.WindowDataset` serves: the
fields and their rates, each item's length (the time every field covers), the items left
out (short, lacking a field, not in the item list) and the window's size, from the
store's manifest (:class:`DatasetSetup`)."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from zstore.errors import ConfigError, some_names
from zstore.format import scale
from zstore.read import WindowReader
from zstore.train._window_draw import usable_items

#: The largest window of one field that a dataset accepts (beyond it, every item would
#: allocate gigabytes: almost always a unit mistake such as milliseconds for seconds).
MAX_WINDOW_BYTES = 4 * 2**30


def common_lengths(lengths: dict[str, Any], rates: dict[str, float], coarse: str) -> np.ndarray:
    """Per item, the frames of the coarsest grid that every time array covers.

    Arrays of one item may end a little apart (``act`` as ceil(samples / 160) frames);
    a window that reached past the shortest would read samples that do not exist, so
    an item's length, and ``length`` in what it returns, is the time all arrays cover.
    """
    out = np.asarray(lengths[coarse], dtype=np.int64)
    for name, rate in rates.items():
        if name == coarse:
            continue
        ratio = rate / rates[coarse]
        n = np.asarray(lengths[name], dtype=np.int64)
        covered = (
            n // int(ratio)
            if float(ratio).is_integer()
            else np.floor(n / ratio + 1e-9).astype(np.int64)
        )
        out = np.minimum(out, covered)
    return out


class ItemLengths:
    """:func:`common_lengths` computed where asked (an item, a slice, positions), so a
    dataset need not hold an array of every item's length."""

    def __init__(self, lengths: dict[str, Any], rates: dict[str, float], coarse: str):
        self.lengths = {n: lengths[n] for n in rates}
        self.rates, self.coarse = rates, coarse

    def __len__(self) -> int:
        return len(self.lengths[self.coarse])

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, np.integer)):  # one item, on every read: in Python
            base = self.rates[self.coarse]
            out = int(self.lengths[self.coarse][key])
            for name, rate in self.rates.items():
                if name != self.coarse:
                    n, ratio = int(self.lengths[name][key]), rate / base
                    covered = (
                        n // int(ratio)
                        if float(ratio).is_integer()
                        else math.floor(n / ratio + 1e-9)
                    )
                    out = min(out, covered)
            return out
        return common_lengths({n: v[key] for n, v in self.lengths.items()}, self.rates, self.coarse)


class DatasetSetup:
    """The part of :class:`zstore.train.dataset.WindowDataset` that works out, from the
    manifest, what it serves (run when it is built and again in each process it is
    unpickled in)."""

    if TYPE_CHECKING:
        url: str
        fields: list[str] | None
        window_seconds: float | None
        short: str
        missing: str
        reader: WindowReader
        _selected: list[str] | None
        _lacking_said: bool
        _untimed_said: bool

    def _setup(self) -> None:
        manifest = self.reader.open().manifest
        untimed = np.zeros(0, dtype=np.int64)
        if self.fields is not None:
            names = self.fields
        else:
            names, untimed = self._default_fields(manifest)
        unknown = [n for n in names if n not in manifest.arrays]
        if not names and not manifest.time_arrays:
            raise ConfigError(
                f"{self.url}: the store has no time arrays (it was converted without "
                f"--rate), so no windows can be cut; reconvert it with the rates, e.g. "
                f"zstore convert SRC {self.url} --overwrite --rate "
                f"{next(iter(manifest.arrays), 'wav')}=16000, or pass fields= and "
                "window_seconds=None for whole arrays"
            )
        if unknown or not names:
            raise ConfigError(
                f"{self.url}: no array(s) {unknown or names} in the store; "
                f"arrays: {sorted(manifest.arrays)}"
            )
        timed = [n for n in names if manifest.arrays[n].rate is not None]
        if self.window_seconds is not None and not timed:
            raise ConfigError(
                f"{self.url}: fields {names} have no time axis, so windows "
                "cannot be cut; pass window_seconds=None or a time array"
            )
        self._rates = {n: float(manifest.arrays[n].rate) for n in timed}  # type: ignore
        self._names = names
        self._coarse = min(timed, key=lambda n: self._rates[n]) if timed else None
        rate = self._rates[self._coarse] if self._coarse else 1.0
        self._window = (
            None
            if self.window_seconds is None or not timed
            else max(1, int(round(self.window_seconds * rate)))
        )
        self._items = manifest.items
        self._field_lengths = {n: manifest.lengths[n] for n in timed}
        # per field, how a window on the coarsest grid maps to its own: a whole-number
        # ratio (a window then ends within the field: the item's length is what every
        # field covers), or None (the field's own length bounds it), or no time axis
        self._rules: list[tuple[str, int | None, float | None]] = []
        for n in names:
            ratio = self._rates[n] / rate if n in self._rates else None
            whole = int(ratio) if ratio is not None and float(ratio).is_integer() else None
            self._rules.append((n, whole, ratio))
        if self._coarse is None:
            self._lengths: Any = np.zeros(len(manifest.items), dtype=np.int64)
        else:
            self._lengths = ItemLengths(manifest.lengths, self._rates, self._coarse)
        if not len(untimed) and self._all_usable(manifest, names):
            # Nothing to filter: no per-item arrays, so opening costs the same at any
            # size, in this process and in every worker that unpickles the dataset.
            self._index: Any = range(len(manifest.items))
            self._short = self._empty = np.zeros(0, dtype=np.int64)
            self._check_window_size()
            return
        chosen = (  # an item list: only its items may lack fields (else all may)
            None
            if self._selected is None
            else np.asarray([manifest.position(n) for n in self._selected], dtype=np.int64)
        )
        lacking = np.union1d(self._lacking(manifest, names, untimed, chosen), untimed)
        self._empty = np.zeros(0, dtype=np.int64)
        if self._coarse is not None:
            self._lengths = self._lengths[:]
        if self._window is not None and self.short == "pad":
            # a recording of no samples is not padded: its window would be zeros only,
            # served with the item's labels ("skip" leaves it out, "error" names it)
            self._empty = np.setdiff1d(np.flatnonzero(self._lengths == 0), lacking)
        self._index, short = usable_items(
            self._lengths, self._window, self.short, self._items, np.union1d(lacking, self._empty)
        )
        if chosen is not None:  # an item list: its items, in its order
            usable = np.zeros(len(self._items), dtype=bool)
            usable[self._index] = True
            self._index = chosen[usable[chosen]]
            short = np.intersect1d(short, chosen)
            self._empty = np.intersect1d(self._empty, chosen)
        self._short = short
        self._check_window_size()

    def _all_usable(self, manifest: Any, names: list[str]) -> bool:
        """Whether every item is served as it is, known without reading every item's
        length: no item list, every item has every field, and the manifest's shortest
        item is at least a window long."""
        if (
            self._selected is not None
            or self.short not in ("pad", "skip", "error")
            or any(manifest.items_with(n) is not None for n in names)
        ):
            return False
        if self._window is None or self._coarse is None:
            return True
        shortest = manifest.extra.get("min_lengths")
        if not isinstance(shortest, dict) or any(n not in shortest for n in self._rates):
            return False  # a store written before zstore recorded it: scan the lengths
        mins = {n: np.asarray([shortest[n]], dtype=np.int64) for n in self._rates}
        return int(common_lengths(mins, self._rates, self._coarse)[0]) >= self._window

    def _default_fields(self, manifest: Any) -> tuple[list[str], np.ndarray]:
        """The fields read when none are named: the time arrays that every item with a
        time array has; and the items with none (a speaker's group holding its
        embedding above its utterances' groups), left out with a warning.  Without a
        time array in every such item, an error says where each one is."""
        if all(manifest.items_with(name) is None for name in manifest.time_arrays):
            return list(manifest.time_arrays), np.zeros(0, dtype=np.int64)  # any size: O(1)
        n = len(manifest.items)
        present = {name: _mask(manifest, name) for name in manifest.time_arrays}
        timed = np.zeros(n, dtype=bool)
        for mask in present.values():
            timed |= mask
        names = [name for name, mask in present.items() if mask[timed].all()]
        if not names and present:
            where = ", ".join(
                f"'{name}' in {int(mask.sum())} of {n} items" for name, mask in present.items()
            )
            first = max(present, key=lambda name: int(present[name].sum()))
            raise ConfigError(
                f"{self.url}: no time array is in every item that has one ({where}); "
                f"name the fields to read and leave out the items without them, e.g. "
                f"fields=[{first!r}], missing='skip'"
            )
        untimed = np.flatnonzero(~timed)
        if not len(untimed) or getattr(self, "_untimed_said", False):
            return names, untimed
        said = untimed  # of the items asked for: an item list's, or every one
        if self._selected is not None:
            said = np.intersect1d(untimed, [manifest.position(i) for i in self._selected])
        self._untimed_said = True  # settled for this dataset, and the workers it reaches
        if len(said):
            shown = some_names([manifest.items[i] for i in said[:5]], len(said))
            warnings.warn(
                f"{self.url}: {len(said)} of {n} item(s) have no time array, so no "
                f"window can be cut from them: {shown}; left out (read their arrays "
                "whole with fields=[...], window_seconds=None)",
                stacklevel=4,
            )
        return names, untimed

    def _lacking(
        self,
        manifest: Any,
        names: list[str],
        untimed: np.ndarray | None = None,
        chosen: np.ndarray | None = None,
    ) -> np.ndarray:
        """Items without some of ``names`` (other than the ``untimed`` ones, left out
        already; of the ``chosen`` ones alone where an item list chose some): an error
        (``missing="error"``), or left out with a warning (``missing="skip"``) when the
        dataset is built."""
        if all(manifest.items_with(n) is None for n in names):
            return np.zeros(0, dtype=np.int64)
        has_all = np.ones(len(manifest.items), dtype=bool)
        for name in names:
            has_all &= _mask(manifest, name)
        if untimed is not None:
            has_all[untimed] = True
        lacking = np.flatnonzero(~has_all)
        if chosen is not None:
            lacking = np.intersect1d(lacking, chosen)
        if not len(lacking) or self._lacking_said:
            return lacking
        shown = some_names([manifest.items[i] for i in lacking[:5]], len(lacking))
        of = len(manifest.items) if chosen is None else len(np.unique(chosen))
        what = f"{len(lacking)} of {of} item(s) lack field(s) of {names}"
        if self.missing == "error":
            raise ConfigError(
                f"{self.url}: {what}: {shown}; pass missing='skip' to "
                "leave them out, or choose fields every item has"
            )
        self._lacking_said = True
        warnings.warn(f"{self.url}: {what}; left out (missing='skip'): {shown}", stacklevel=4)
        return lacking

    def _check_window_size(self) -> None:
        """Refuse a window so large that one item would not fit in memory."""
        if self._window is None or not len(self._index):
            return
        position = int(self._index[0])
        first = self._items[position]
        coarse_rate = self._rates[self._coarse]  # type: ignore[index]
        for name, rate in self._rates.items():
            layout = self.reader.layout(first, name, position)
            nbytes = scale(self._window, coarse_rate, rate) * layout.step_nbytes
            if nbytes > MAX_WINDOW_BYTES:
                raise ConfigError(
                    f"window_seconds={self.window_seconds}: one window of '{name}' would take "
                    f"{nbytes / 2**30:.1f} GiB (more than {MAX_WINDOW_BYTES // 2**30} GiB); "
                    "use a shorter window, or window_seconds=None for whole items"
                )


def _mask(manifest: Any, name: str) -> np.ndarray:
    """Which items have array ``name``."""
    have = manifest.items_with(name)
    if have is None:
        return np.ones(len(manifest.items), dtype=bool)
    mask = np.zeros(len(manifest.items), dtype=bool)
    mask[have] = True
    return mask
