"""The readers tools/bench.py compares, each reading the same (item, start) windows.

Every contender returns ``(wav, act)`` numpy arrays for a 10 s window; handles are
opened lazily per process so a contender can run inside DataLoader workers.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

HOP = 160


@dataclass
class Paths:
    h5: str
    store: str
    arrow: str
    work: str


@dataclass
class Contender:
    """A named reader; ``kind`` picks the implementation, ``options`` its settings."""

    name: str
    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    _pid: int = -1
    _state: Any = None

    def open(self, paths: Paths) -> None:
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._state = OPENERS[self.kind](paths, self.options)

    def read(
        self, paths: Paths, index: int, item: str, start: int, frames: int
    ) -> tuple[np.ndarray, np.ndarray]:
        self.open(paths)
        return READERS[self.kind](self._state, index, item, start, frames)

    def settle(self) -> None:
        """Wait for the fills a zstore reader runs behind its reads (a warm-up's last
        shards are otherwise still filling during the first timed pass)."""
        if hasattr(self._state, "settle"):
            self._state.settle(timeout=600)

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, **state)


def _modelled(options: dict[str, Any]) -> Any:
    if "latency" not in options:
        return None
    from zstore.testing import ModelledFileSystem

    return ModelledFileSystem(latency=options["latency"], bandwidth=options.get("bandwidth", 0))


# --- h5py ---------------------------------------------------------------------------


def _open_h5(paths: Paths, options: dict[str, Any]) -> Any:
    import h5py

    fs = _modelled(options)
    if fs is None:
        return h5py.File(paths.h5, "r")
    return h5py.File(fs.open(paths.h5, "rb", block_size=options.get("block", 2**20)), "r")


def _read_h5_whole(f: Any, index: int, item: str, start: int, frames: int):
    group = f[item]
    wav, act = group["wav"][()], group["act"][()]  # the users' code: whole group, then crop
    return (
        np.ascontiguousarray(wav[:, start * HOP : (start + frames) * HOP]),
        np.ascontiguousarray(act[:, start : start + frames]),
    )


def _read_h5_slab(f: Any, index: int, item: str, start: int, frames: int):
    group = f[item]
    return (
        group["wav"][:, start * HOP : (start + frames) * HOP],
        group["act"][:, start : start + frames],
    )


# --- Hugging Face datasets ----------------------------------------------------------


def _open_hf(paths: Paths, options: dict[str, Any]) -> Any:
    import datasets

    ds = datasets.load_from_disk(paths.arrow)
    ds.set_format("torch")
    return ds


def _read_hf(ds: Any, index: int, item: str, start: int, frames: int):
    row = ds[index]  # the whole item, as advised; wav is stored (samples, mics)
    wav = row["wav"][start * HOP : (start + frames) * HOP].T.contiguous()
    act = row["act"][start : start + frames].T.contiguous()
    return wav.numpy(), act.numpy()


# --- zarr-python and zstore ---------------------------------------------------------


def _open_zarr(paths: Paths, options: dict[str, Any]) -> Any:
    import zarr

    return zarr.open_group(paths.store, mode="r")


def _read_zarr(root: Any, index: int, item: str, start: int, frames: int):
    return (
        root[f"{item}/wav"][:, start * HOP : (start + frames) * HOP],
        root[f"{item}/act"][:, start : start + frames],
    )


def zstore_cache(paths: Paths, options: dict[str, Any]) -> Any:
    import zstore

    if options.get("cache") is None:
        return None
    c = options["cache"]
    return zstore.CacheConfig(
        ram_dir=c.get("ram_dir"),
        ram_bytes=c.get("ram_bytes", 0),
        ssd_dir=c.get("ssd_dir"),
        ssd_bytes=c.get("ssd_bytes", 0),
        ram_format=c.get("ram_format", "decoded"),
        fetch=c.get("fetch", "range"),
    )


def _open_zstore(paths: Paths, options: dict[str, Any]) -> Any:
    from zstore.read import WindowReader

    return WindowReader(
        paths.store, cache=zstore_cache(paths, options), origin_fs=_modelled(options)
    ).open()


def window_spans(start: int, frames: int) -> dict[str, Any]:
    """zstore spans of the window of ``frames`` act frames from ``start`` (wav aligned)."""
    from zstore.format import Span

    return {"wav": Span(start * HOP, (start + frames) * HOP), "act": Span(start, start + frames)}


def _read_zstore(reader: Any, index: int, item: str, start: int, frames: int):
    out = reader.read(item, window_spans(start, frames))
    return out["wav"], out["act"]


OPENERS = {
    "h5-whole": _open_h5,
    "h5-slab": _open_h5,
    "hf": _open_hf,
    "zarr": _open_zarr,
    "zstore": _open_zstore,
}
READERS = {
    "h5-whole": _read_h5_whole,
    "h5-slab": _read_h5_slab,
    "hf": _read_hf,
    "zarr": _read_zarr,
    "zstore": _read_zstore,
}


def run_windows(
    contender: Contender,
    paths: Paths,
    windows: list[tuple[int, str, int]],
    frames: int,
    budget_s: float,
) -> tuple[int, float]:
    """Read windows until done or ``budget_s`` passes; return (count, seconds)."""
    contender.open(paths)
    t0 = time.perf_counter()
    n = 0
    for index, item, start in windows:
        contender.read(paths, index, item, start, frames)
        n += 1
        if time.perf_counter() - t0 > budget_s:
            break
    return n, time.perf_counter() - t0


def smaps(pid: int | str = "self") -> dict[str, int]:
    """PSS fields of a process in bytes, from /proc/PID/smaps_rollup."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def rank_worker(
    paths: Paths,
    options: dict[str, Any],
    windows: list[tuple[int, str, int]],
    frames: int,
    barrier: Any,
    queue: Any,
    release: Any,
) -> None:
    """One 'rank' of the shared-cache scenario: open, read its windows twice, report memory.

    The per-process base is the private memory after the first pass: imports, handles,
    working buffers and the reader's bookkeeping for every shard the rank has touched
    (layouts, shard indexes, maps).  The second pass reads the same windows again through
    the shared tiers; 'final' is measured after it, with the node's memory.
    """
    import gc

    contender = Contender("rank", "zstore", options)
    contender.open(paths)
    gc.collect()
    opened = smaps()
    barrier.wait()
    t0 = time.perf_counter()
    for index, item, start in windows:
        contender.read(paths, index, item, start, frames)
    gc.collect()
    base = smaps()
    for index, item, start in windows:
        contender.read(paths, index, item, start, frames)
    seconds = time.perf_counter() - t0
    gc.collect()
    queue.put(
        {
            "pid": os.getpid(),
            "windows": 2 * len(windows),
            "seconds": seconds,
            "opened": opened,
            "base": base,
            "final": smaps(),
        }
    )
    release.wait(600)  # keep the maps alive until the node has been measured
