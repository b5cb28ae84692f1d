"""The ``copies`` kind of tools/random_corpora.py: copies of a store, and a store
restored from a backup, each appended to with other files, read through one node cache.

Each seed converts a file of 1-5 recordings, copies the store 1-2 times (a directory
copy, or on S3 an object copy: the store id goes with it) and appends to each store in
turn 1-2 files of its own whose items have the same names in every store (so the same
item directories, and for packed items the same new shards and batch records).  For 1
seed in 3 one store is then restored from a backup taken before its appends and
appended to again with yet other files, under a job opened before: each item that job
reads must be its own view's (from its tiers), or it is told the store was replaced
(``StoreReplacedError``).  Every store is read through one node cache
(random tiers) in a random order, twice, whole items and random windows: every value
must be its own store's source's, bit for bit.  Keyed by the store id alone, the tiers
served one store's appended chunks for another's (CHANGELOG).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import numpy as np

Data = dict[str, dict[str, np.ndarray]]


def _copy(src: str, dst: str, so: dict[str, Any] | None) -> None:
    if so is None:
        shutil.copytree(src, dst)
        return
    import fsspec

    fs, path = fsspec.core.url_to_fs(src, **so)
    fs.copy(path, fsspec.core.url_to_fs(dst, **so)[1], recursive=True)
    fs.invalidate_cache()


def _remove(store: str, so: dict[str, Any] | None) -> None:
    if so is None:
        shutil.rmtree(store)
        return
    import fsspec

    fs, path = fsspec.core.url_to_fs(store, **so)
    fs.rm(path, recursive=True)
    fs.invalidate_cache()


def _check(store: str, want: Data, cache: dict[str, Any] | None, so: Any, seed: int) -> int:
    """Every item of ``store`` whole, then windows of 2 epochs, against ``want``."""
    import random_odd
    from random_corpora import check_window, windows

    import zstore

    config = zstore.CacheConfig(**cache) if cache else False
    whole = zstore.WindowDataset(
        store, window_seconds=None, fields=["wav", "act"], cache=config, storage_options=so
    )
    assert len(whole) == len(want), (store, len(whole), len(want))
    n = 0
    for i in range(len(whole)):
        w = whole[i]
        for name in ("wav", "act"):
            random_odd.same(w[name].numpy(), want[w["item"]][name], (store, w["item"], name))
        n += 1
    ds = zstore.WindowDataset(
        store,
        window_seconds=0.5,
        windows_per_item=2,
        fields=["wav", "act"],
        cache=config,
        storage_options=so,
        seed=seed,
    )
    for epoch, batch in ((0, 3), (1, 0)):
        for w in windows(ds, epoch, batch):
            check_window(w, want, "channels_first")  # the recordings' layout
            n += 1
    if cache:
        assert ds.settle(timeout=120) and whole.settle(timeout=120)
    return n


def _running(job: Any, want: Data) -> int:
    """A job opened before its store was restored and appended to again: each item it
    reads is its own view's (from its tiers), or it is told the store was replaced."""
    import random_odd

    import zstore

    n = 0
    for i in range(len(job)):
        try:
            w = job[i]
        except zstore.StoreReplacedError:
            continue
        random_odd.same(w["wav"].numpy(), want[w["item"]]["wav"], ("running job", w["item"]))
        n += 1
    return n


def copies(seed: int, where: str, remote: bool) -> str:
    """One seed of the ``copies`` kind (see the module)."""
    import random_odd
    from random_corpora import _cache_options, _no_corrupt, _recordings, _tiers

    import zstore

    rng = np.random.default_rng(seed)
    s3 = random_odd.on_s3(rng, seed)
    so = s3.get("storage_options")
    first = s3.get("store") or os.path.join(where, "store.zarr")
    base = os.path.join(where, "base.h5")
    want0 = _recordings(rng, base, "b")
    options: dict[str, Any] = {
        "rates": {"wav": 16000, "act": 100},
        "workers": 1,
        "progress": False,
        "chunk_seconds": float(rng.choice([0.5, 1.0])),
        "storage_options": so,
    }
    zstore.convert(base, first, pack_seconds=float(rng.choice([0.0, 10.0])), **options)
    backup = first.replace("store.zarr", "backup.zarr")
    _copy(first, backup, so)
    stores = [first] + [
        first.replace("store.zarr", f"copy{k}.zarr") for k in range(int(rng.integers(1, 3)))
    ]
    for store in stores[1:]:
        _copy(first, store, so)
    want: dict[str, Data] = {}
    files = 0

    def appended(store: str, rounds: int) -> Data:
        """``rounds`` files appended to ``store``, each of items named alike in every
        store (``n<round>_<i>``), values of their own."""
        nonlocal files
        data: Data = dict(want0)
        for r in range(rounds):
            path = os.path.join(where, f"f{files}", "new.h5")  # one stem: one naming
            os.makedirs(os.path.dirname(path))
            files += 1
            new = _recordings(rng, path, f"n{r}_")
            zstore.append(path, store, **options)
            data.update(new)
        return data

    rounds = int(rng.integers(1, 3))
    for store in stores:
        want[store] = appended(store, rounds)
    restored = rng.random() < 1 / 3
    cache = _cache_options(rng, where)
    order = [str(s) for s in rng.permutation(stores)]
    n = 0
    if restored:  # read once, then one store restored and appended to again
        n += sum(_check(s, want[s], cache, so, seed) for s in order)
        config = zstore.CacheConfig(**cache) if cache else False
        job = zstore.WindowDataset(
            first, window_seconds=None, fields=["wav"], cache=config, storage_options=so
        )
        _remove(first, so)
        _copy(backup, first, so)
        old, want[first] = want[first], appended(first, rounds)
        n += _running(job, old)
    for _ in range(2):
        n += sum(_check(s, want[s], cache, so, seed) for s in order)
    _no_corrupt(cache)
    return (
        f"{n} reads of {len(stores)} stores, {rounds} append(s) each, restored {restored}; "
        f"{_tiers(cache)}, {'s3' if so else 'local'}"
    )
