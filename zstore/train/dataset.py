"""``WindowDataset``: a map-style torch Dataset of random time windows.  Thin: no cache logic."""

from __future__ import annotations

import json
import math
import os
import pickle
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from zstore.cache import CacheConfig, as_cache_config
from zstore.errors import ConfigError
from zstore.format import Span, scale
from zstore.read import WindowReader
from zstore.train._window_draw import Window, usable_items, window_for

#: The largest window of one field that a dataset accepts (beyond it, every item would
#: allocate gigabytes: almost always a unit mistake such as milliseconds for seconds).
MAX_WINDOW_BYTES = 4 * 2**30


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


ITEM_LIST_FORMS = (
    "a text file with one item name per line ('#' comments), a JSON list of names, or a "
    "pickled list or tuple of names"
)


def read_item_list(path: str) -> list[str]:
    """The item names in the file ``path``: a pickled list or tuple of names (as HDF5
    dataset code keeps its subsets; unpickling runs the file's code, so it is loaded only
    because the user named it), a JSON list, or text with one name per line."""
    try:
        with open(os.path.expanduser(path), "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(
            f"items={path!r}: cannot read the item list ({e.strerror}); pass "
            f"{ITEM_LIST_FORMS}, or a list of names"
        ) from None
    try:
        if raw[:1] == b"\x80":  # a pickle (protocol 2 and later)
            names = pickle.loads(raw)
        elif raw.lstrip()[:1] == b"[":
            names = json.loads(raw)
        else:
            lines = (line.strip() for line in raw.decode("utf-8").splitlines())
            names = [n for n in lines if n and not n.startswith("#")]
    except Exception as e:  # an unreadable pickle, JSON or text: say which forms work
        raise ConfigError(
            f"items={path!r}: cannot read it as an item list ({type(e).__name__}); pass "
            f"{ITEM_LIST_FORMS}"
        ) from None
    if isinstance(names, np.ndarray):
        names = names.tolist()
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, (str, bytes)) for n in names):
        raise ConfigError(
            f"items={path!r}: holds a {type(names).__name__}, not a list of item names; "
            f"pass {ITEM_LIST_FORMS}"
        )
    return [n.decode() if isinstance(n, bytes) else n for n in names]


def select_items(reader: WindowReader, items: Any, url: str) -> list[str]:
    """The item names an ``items=`` argument stands for, checked against the store."""
    known = reader.manifest.items
    if callable(items):
        chosen = []
        for i, n in enumerate(known):
            try:
                keep = items(n, reader.item_attrs(i))
            except Exception as e:
                raise ConfigError(
                    f"{url}: the items= callable raised {type(e).__name__} "
                    f"({e}) on item {n!r}; fix it so that it returns True or "
                    "False for every item"
                ) from e
            if keep:
                chosen.append(n)
        return chosen
    if isinstance(items, (str, os.PathLike)):
        names = read_item_list(os.fspath(items))
    else:
        names = [str(n) for n in items]
    unknown = [n for n in names if n not in known]
    if unknown:
        shown = ", ".join(repr(n) for n in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ConfigError(
            f"{url}: {len(unknown)} item(s) of the item list are not in the "
            f"store: {shown}{more} (items are named like {known[0]!r}; "
            "see zstore info)"
        )
    if len(set(names)) != len(names):
        raise ConfigError(
            f"{url}: the item list names some items twice; use "
            "windows_per_item for more windows per item"
        )
    return names


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


class _Lengths:
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


class WindowDataset(torch.utils.data.Dataset):
    """Item ``i`` is a random window of utterance ``i``, drawn from ``(seed, epoch, i)``.

    Args:
        url: the store (path or fsspec URL) written by ``zstore convert``.
        fields: arrays to read (default: every time array that every item has).  Non-time arrays are
            returned whole.
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
    ):
        self.url = str(url)
        self.fields = list(fields) if fields is not None else None
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
        if len(self._short) and short != "error":
            what = "padded with zeros" if short == "pad" else "left out"
            warnings.warn(
                f"{self.url}: {len(self._short)} item(s) shorter than "
                f"{window_seconds} s are {what} (short={short!r})",
                stacklevel=2,
            )

    def _setup(self) -> None:
        manifest = self.reader.open().manifest
        names = (
            self.fields
            if self.fields is not None
            else [n for n in manifest.time_arrays if manifest.items_with(n) is None]
        )
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
            self._lengths = _Lengths(manifest.lengths, self._rates, self._coarse)
        if self._all_usable(manifest, names):
            # Nothing to filter: no per-item arrays, so opening costs the same at any
            # size, in this process and in every worker that unpickles the dataset.
            self._index: Any = range(len(manifest.items))
            self._short = np.zeros(0, dtype=np.int64)
            self._check_window_size()
            return
        if self._coarse is not None:
            self._lengths = self._lengths[:]
        self._index, short = usable_items(self._lengths, self._window, self.short, self._items)
        lacking = self._lacking(manifest, names)
        if len(lacking):
            self._index = np.setdiff1d(self._index, lacking)
            short = np.setdiff1d(short, lacking)
        if self._selected is not None:  # an item list: its items, in its order
            usable = np.zeros(len(self._items), dtype=bool)
            usable[self._index] = True
            chosen = np.asarray([manifest.position(n) for n in self._selected], dtype=np.int64)
            self._index = chosen[usable[chosen]]
            short = np.intersect1d(short, chosen)
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

    def _lacking(self, manifest: Any, names: list[str]) -> np.ndarray:
        """Items without some of ``names``: an error (``missing="error"``), or left out
        with a warning (``missing="skip"``) when the dataset is built."""
        if all(manifest.items_with(n) is None for n in names):
            return np.zeros(0, dtype=np.int64)
        has_all = np.ones(len(manifest.items), dtype=bool)
        for name in names:
            have = manifest.items_with(name)
            if have is not None:
                mask = np.zeros(len(manifest.items), dtype=bool)
                mask[have] = True
                has_all &= mask
        lacking = np.flatnonzero(~has_all)
        if not len(lacking) or self._lacking_said:
            return lacking
        shown = ", ".join(repr(manifest.items[i]) for i in lacking[:5])
        more = f" and {len(lacking) - 5} more" if len(lacking) > 5 else ""
        what = f"{len(lacking)} of {len(manifest.items)} item(s) lack field(s) of {names}"
        if self.missing == "error":
            raise ConfigError(
                f"{self.url}: {what}: {shown}{more}; pass missing='skip' to "
                "leave them out, or choose fields every item has"
            )
        self._lacking_said = True
        warnings.warn(f"{self.url}: {what}; left out (missing='skip'): {shown}{more}", stacklevel=4)
        return lacking

    @property
    def short_items(self) -> list[str]:
        """Names of the items shorter than the window (padded, or left out)."""
        return [self._items[int(i)] for i in self._short]

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

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_lengths", "_items", "_index", "_short", "_field_lengths", "_plain_seen"):
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
        n = len(self)
        if not 0 <= i < n:  # a negative index is a caller's bug, never the last item
            raise IndexError(f"index {i} out of range for {n} windows (0 to {n - 1})")
        item_i, j = divmod(i, self.windows_per_item)
        item = int(self._index[item_i])
        return window_for(item, int(self._lengths[item]), self._window, self.seed, epoch, j)

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

    def __getitem__(self, i: int | tuple[int, int]) -> dict[str, Any]:
        w = self.window(i)
        name = self._items[w.item]
        arrays = self.reader.read(name, self._spans(w), w.item)
        coarse_rate = self._rates[self._coarse] if self._coarse else 1.0
        out: dict[str, Any] = {field: torch.from_numpy(arr) for field, arr in arrays.items()}
        out["item"] = name
        out["start"] = w.start / coarse_rate
        out["length"] = w.take
        return self.transform(out) if self.transform is not None else out
