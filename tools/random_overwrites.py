"""The ``overwrites`` kind of tools/random_corpora.py: a store converted again with
``--overwrite`` (and appended to) while a job reads it.

Each seed writes two versions of one corpus, whose ``wav`` values differ (every sample
at least 1000/32768 in the first, at most -1994/32768 in the second) but compress to
the same sizes, so the old store's shard indexes fit the new store's objects byte for
byte: the case where a job that did not notice the overwrite would decode the new
values without an error.  A reader process (random tiers, ``ds[i]`` or
``WindowLoader``) reads epoch after epoch while this process overwrites the store with
the other version, again and again, now and then appending an item to it (of values
of neither version).  The reader
opens the store anew after each refusal.  It must never return a window holding
values of a store other than the one it opened, and every error it meets mid-read must
be :class:`zstore.StoreReplacedError`; opening a store that is being converted must
fail with the converter's own refusal (no root yet, or a conversion in progress), or
with :class:`zstore.StoreReplacedError` (its item table gone under the opening).
``--s3``: the store on the local S3 endpoint for 7 seeds in 10.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import warnings
from typing import Any

import h5py
import numpy as np

#: what opening a store mid-conversion says (a store removed, or begun, not finished)
OPENING = ("no zarr.json at the root", "its conversion has not finished")


def versions(rng: np.random.Generator, where: str) -> tuple[str, str, str]:
    """Two versions of one corpus (a.h5, b.h5) and a third file of one more item."""
    items = int(rng.integers(2, 5))
    seconds = [int(rng.integers(2, 9)) for _ in range(items)]
    paths = []
    for name, level in (("a.h5", 1000), ("b.h5", -2000)):
        with h5py.File(os.path.join(where, name), "w") as f:
            for i, n in enumerate(seconds):
                wave = level + (np.arange(16000 * n) % 7)
                f[f"rec{i}/wav"] = (wave[None] / 32768).astype(np.float32)
        paths.append(os.path.join(where, name))
    extra = os.path.join(where, "more.h5")
    with h5py.File(extra, "w") as f:  # values of neither version: "c"
        f["late0/wav"] = ((5000 + np.arange(16000 * 3) % 7)[None] / 32768).astype(np.float32)
    return paths[0], paths[1], extra


def _kind(wav: np.ndarray) -> str:
    """Which file a window's values are of: "a", "b", "c" (the appended item), or "?"
    (mixed, or none of them)."""
    low, high = float(wav.min()) * 32768, float(wav.max()) * 32768
    for kind, (lo, hi) in {"a": (1000, 1006), "b": (-2000, -1994), "c": (5000, 5006)}.items():
        if lo - 0.5 <= low and high <= hi + 0.5:
            return kind
    return "?"


def reader(args: tuple[Any, ...]) -> dict[str, Any]:
    """The job: reads ``store`` until ``stop`` is set, opening it anew after each
    refusal; what it saw, by store id."""
    store, so, cache, window, mode, started, stop = args
    warnings.simplefilter("ignore")
    from random_corpora import windows

    import zstore

    seen: dict[str, set[str]] = {}
    report: dict[str, Any] = {"windows": 0, "refused": 0, "opening": 0, "wrong": []}
    while not stop.is_set():
        try:
            ds = zstore.WindowDataset(
                store,
                window_seconds=window,
                windows_per_item=2,
                cache=zstore.CacheConfig(**cache) if cache else False,
                fields=["wav"],
                storage_options=so,
            )
        except Exception as e:  # what opening a store mid-conversion may say
            expected = isinstance(e, zstore.StoreReplacedError) or (
                isinstance(e, zstore.StoreFormatError) and any(w in str(e) for w in OPENING)
            )
            if not expected:
                report["wrong"].append(f"opening: {type(e).__name__}: {e}")
            report["opening"] += 1
            continue
        store_id = ds.reader.manifest.store_id
        try:
            for epoch in range(10**6):
                for w in windows(ds, epoch, 3 if mode == "loader" else 0, ("wav",)):
                    kind = _kind(w["wav"].numpy())
                    if w["item"] == "late0":  # appended: its own values, whatever the store
                        kind = "a/b" if kind == "c" else f"late0 as {kind}"
                    seen.setdefault(store_id, set()).add(kind)
                    report["windows"] += 1
                    started.set()
                if stop.is_set():
                    break
        except Exception as e:  # a LoaderError wraps the reader's own
            cause = e if isinstance(e, zstore.StoreReplacedError) else e.__cause__
            if isinstance(cause, zstore.StoreReplacedError):
                report["refused"] += 1
            else:
                report["wrong"].append(f"mid-read: {type(e).__name__}: {e}")
        started.set()
    report["seen"] = {k: sorted(v) for k, v in seen.items()}
    return report


def overwrites(seed: int, where: str, remote: bool) -> str:
    """One seed of the ``overwrites`` kind (see the module)."""
    import random_odd
    from random_corpora import _cache_options, _tiers

    import zstore

    rng = np.random.default_rng(seed)
    a, b, extra = versions(rng, where)
    s3 = random_odd.on_s3(rng, seed)
    store = s3.pop("store", os.path.join(where, "store.zarr"))
    so = s3.get("storage_options")
    options: dict[str, Any] = {
        **s3,
        "rates": {"wav": 16000},
        "workers": 1,
        "progress": False,
        "pack_seconds": float(rng.choice([0.0, 10.0])),
        "chunk_seconds": float(rng.choice([0.5, 1.0])),
    }
    zstore.convert(a, store, **options)
    cache = _cache_options(rng, where)
    window = float(rng.choice([0.5, 1.0, 2.0]))
    mode = str(rng.choice(["items", "loader"]))
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        started, stop = manager.Event(), manager.Event()
        with ctx.Pool(1) as pool:
            job = pool.apply_async(reader, ((store, so, cache, window, mode, started, stop),))

            def read_on() -> None:
                """Until the job has read on (or failed) since the last step."""
                while not started.wait(timeout=1.0):
                    if job.ready():
                        job.get()  # its error, here
                        raise AssertionError("the job stopped before it was told to")

            read_on()
            steps: list[str] = []
            appended = False  # late0 is in the store now
            for k in range(int(rng.integers(3, 9))):
                started.clear()
                if rng.random() < 0.25 and not appended:  # an append is not a replacement
                    zstore.append(extra, store, workers=1, progress=False, storage_options=so)
                    steps.append("+")
                    appended = True
                    continue
                appended = False
                version = b if k % 2 == 0 else a
                zstore.convert(version, store, overwrite=True, **options)
                steps.append("b" if version == b else "a")
                read_on()
            stop.set()
            report = job.get(timeout=600)
    assert not report["wrong"], report["wrong"][:5]
    mixed = {k: v for k, v in report["seen"].items() if len(set(v) - {"a/b"}) > 1 or "?" in v}
    mixed.update({k: v for k, v in report["seen"].items() if any("late0 as" in x for x in v)})
    assert not mixed, ("windows of another store, or mixed", mixed)
    return (
        f"{report['windows']} windows of {len(report['seen'])} stores, "
        f"{report['refused']} refused mid-read, {report['opening']} opened mid-conversion; "
        f"steps {''.join(steps)}; {_tiers(cache)}, {'s3' if so else 'local'}, {mode}, "
        f"window {window}"
    )
