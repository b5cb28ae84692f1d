"""Random corpora and settings, read through zstore: every value equals h5py's.

    python tools/random_corpora.py reads --seeds 0:400            # one process
    python tools/random_corpora.py reads --seeds 0:400 --remote   # a modelled origin too
    python tools/random_corpora.py ranks --seeds 0:60 [--remote]  # processes at once
    python tools/random_corpora.py appends --seeds 0:150          # converted in parts
    python tools/random_corpora.py kills --seeds 0:200            # kill -9, run again
    python tools/random_corpora.py reader-kills --seeds 0:200     # a reader killed
    python tools/random_corpora.py odd --seeds 0:200 [--s3]       # HDF5 as it comes
    python tools/random_corpora.py overwrites --seeds 0:100       # --overwrite under a job
    python tools/random_corpora.py copies --seeds 0:100           # copies appended apart

Each seed writes a small HDF5 file of its own with h5py: 1-6 recordings of 0.05-70 s
(``wav`` at 16 kHz as channels x samples, samples x channels or mono; int16-valued
float32, true float, float64 or raw int16, native or big-endian; contiguous, chunked,
gzip, lzf or fletcher32; part of a chunked dataset never written, read as its fill
value; ``act`` at 100 frames/s), converts it with random chunk and pack lengths, and
reads it with random cache settings (none, RAM, SSD, both; every RAM form and fetch
mode; budgets from 1 MB), window lengths and windows per item, through
``WindowLoader`` and ``ds[i]`` over several epochs.  Every window must equal the
source bit for bit, its padding must be zeros, and no tier may count a corrupt value.

``ranks`` reads one store from 2-3 processes at once through one node cache
(``WindowLoader``, a ``DataLoader`` of 2 workers, ``ds[i]``); ``appends`` converts
2-4 files in parts (patterns, appends, reruns) and checks that every item is in the
store once with its values; ``kills`` converts or appends in a process killed with
SIGKILL (with its workers) at a random moment once it writes, runs it again, and checks
the same; ``reader-kills`` kills a process reading through the tiers once it writes
into them, then reads every window through the same tiers; ``odd`` converts files with
odd HDF5 features (tools/random_odd.py); ``overwrites`` converts a store again and
again under a running job (tools/random_overwrites.py); ``copies`` appends other files
to copies of a store, and to one restored from a backup, and reads them all through one
node cache (tools/random_copies.py).  ``--s3`` puts 7 stores in 10
on a local S3 endpoint.  A failing seed prints its
settings and traceback, and the run exits 1.  tests/test_random_corpora.py runs a few
seeds of each; runs of hundreds found a race in a process's first reads, a rerun
refused after a kill, and a store overwritten under a job named as damaged
(CHANGELOG).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import random_copies  # noqa: E402
import random_odd  # noqa: E402
import random_overwrites  # noqa: E402

Data = dict[str, dict[str, np.ndarray]]
STORAGE = random_odd.STORAGE


def corpus(rng: np.random.Generator, path: str) -> tuple[Data, str]:
    """A random HDF5 file at ``path``: ({item: {"wav": channels x samples as read
    back, "act": speakers x frames}}, the layout of ``wav`` in the file)."""
    layout = str(rng.choice(["channels_first", "time_first", "mono"]))
    kind = str(rng.choice(["int16", "float", "float64_int16", "mixed"]))
    dtype = str(rng.choice(["<f4", ">f4", "<i2", ">i2"]))
    storage = dict(STORAGE[int(rng.integers(len(STORAGE)))])
    holes = bool(rng.random() < 0.3)
    channels = int(rng.integers(1, 4))
    data: Data = {}
    with h5py.File(path, "w") as f:
        for i in range(int(rng.integers(1, 7))):
            seconds = float(rng.choice([0.05, 0.3, 1.0, 2.5, 7.3, 19.9, 33.0, 64.0, 70.01]))
            frames = max(1, int(seconds * 100))
            n = frames * 160
            if kind == "float" or (kind == "mixed" and i % 2):
                wav = (rng.standard_normal((channels, n)) * 0.1).astype(np.float32)
            else:
                wide = np.float64 if kind == "float64_int16" else np.float32
                wav = (rng.integers(-32768, 32768, (channels, n)) / 32768).astype(wide)
            if layout == "mono":
                wav = wav[:1]
            if kind == "int16" and dtype in ("<i2", ">i2"):
                stored = np.round(wav * 32768).astype(dtype)
            elif dtype == ">f4" and wav.dtype == np.float32:
                stored = wav.astype(">f4")
            else:
                stored = wav
            stored = {"time_first": stored.T, "mono": stored[0]}.get(layout, stored)
            g = f.create_group(f"u{i:02d}")
            options = dict(storage)
            if options:
                options["chunks"] = _h5_chunks(stored.shape, layout)
            if holes and options and n > 20000:
                # the second half of the time axis is never written: HDF5 reads it as 0
                dataset = g.create_dataset(
                    "wav", shape=stored.shape, dtype=stored.dtype, fillvalue=0, **options
                )
                half = stored.copy()
                cut = (
                    (slice(None), slice(n // 2, None))
                    if layout == "channels_first"
                    else (slice(n // 2, None),)
                )
                half[cut] = 0
                keep = (
                    (slice(None), slice(0, n // 2))
                    if layout == "channels_first"
                    else (slice(0, n // 2),)
                )
                dataset[keep] = stored[keep]
                stored = half
            else:
                g.create_dataset("wav", data=stored, **options)
            act = (rng.random((2, frames)) > 0.5).astype(np.float32)
            g["act"] = act
            back = {"time_first": stored.T, "mono": stored[None]}.get(layout, stored)
            data[f"u{i:02d}"] = {
                "wav": np.asarray(back, dtype=back.dtype.newbyteorder("=")),
                "act": act,
            }
    return data, layout


def _h5_chunks(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    want = {"channels_first": (2, 5000), "time_first": (5000, 2), "mono": (7001,)}[layout]
    return tuple(max(1, min(s, c)) for s, c in zip(shape, want))


def check_window(w: dict[str, Any], data: Data, layout: str) -> None:
    """One window (``ds[i]``'s form) against the source: its span bit for bit, zeros
    past its length."""
    start, n = round(w["start"] * 100), int(w["length"])
    src = data[w["item"]]
    wav = w["wav"].numpy()
    wav = {"time_first": wav.T, "mono": wav[None]}.get(layout, wav)
    want = src["wav"][:, start * 160 : (start + n) * 160].astype(wav.dtype)
    got = wav[:, : n * 160]
    where = (w["item"], round(w["start"], 3), n)
    assert got.shape == want.shape, (*where, got.shape, want.shape)
    bits = np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(want).view(np.uint8)
    assert np.array_equal(*bits), (*where, "wav")
    assert not wav[:, n * 160 :].any(), (*where, "wav padding")
    act = w["act"].numpy()
    assert np.array_equal(act[:, :n], src["act"][:, start : start + n]), (*where, "act")
    assert not act[:, n:].any(), (*where, "act padding")


def windows(
    ds: Any, epoch: int, batch: int, fields: tuple[str, ...] = ("wav", "act")
) -> Iterator[dict[str, Any]]:
    """Epoch ``epoch`` of ``ds``: through ``WindowLoader(batch_size=batch)``, or
    ``ds[i]`` when ``batch`` is 0; a batch's ``fields`` taken apart window by window."""
    import zstore

    ds.set_epoch(epoch)
    if not batch:
        yield from (ds[i] for i in range(len(ds)))
        return
    loader = zstore.WindowLoader(ds, batch_size=batch, shuffle=True)
    loader.set_epoch(epoch)
    for b in loader:
        for k in range(len(b["item"])):
            yield {
                "item": b["item"][k],
                "start": float(b["start"][k]),
                "length": int(b["length"][k]),
                **{name: b[name][k] for name in fields},
            }


def _converted(
    rng: np.random.Generator, where: str, store: str | None = None, **extra: Any
) -> tuple[str, str, Data, str, dict[str, Any]]:
    """(HDF5 path, store, source values, layout, convert options) of a new corpus
    (at ``store``, default in ``where``; ``extra``: more convert options)."""
    import zstore

    h5 = os.path.join(where, "corpus.h5")
    data, layout = corpus(rng, h5)
    options: dict[str, Any] = {
        "rates": {"wav": 16000, "act": 100},
        "workers": 1,
        "progress": False,
        "chunk_seconds": float(rng.choice([0.5, 1.0, 2.0, 4.0])),
        "pack_seconds": float(rng.choice([0.0, 10.0, 30.0])),
    }
    if layout == "time_first":
        options["time_axis"] = {"wav": 0}
    if any(v["wav"].dtype == np.float64 for v in data.values()):
        options["dtypes"] = {"wav": "float32"}  # int16 values: exact
        for v in data.values():
            v["wav"] = v["wav"].astype(np.float32)
    options.update(extra)
    store = store or os.path.join(where, "store.zarr")
    zstore.convert(h5, store, **options)
    return h5, store, data, layout, options


def _cache_options(rng: np.random.Generator, where: str) -> dict[str, Any] | None:
    tiers = str(rng.choice(["none", "ram", "ssd", "ram+ssd"]))
    if tiers == "none":
        return None
    return {
        "ram_dir": os.path.join(where, "ram") if "ram" in tiers else None,
        "ram_bytes": str(rng.choice(["1MB", "4MB", "64MB", "512MB"])),
        "ram_format": str(rng.choice(["auto", "chunks", "decoded", "encoded"])),
        "ssd_dir": os.path.join(where, "ssd") if "ssd" in tiers else None,
        "ssd_bytes": str(rng.choice(["2MB", "256MB"])),
        "fetch": str(rng.choice(["auto", "range", "slots", "shard"])),
    }


def _tiers(cache: dict[str, Any] | None) -> str:
    """The cache settings in a line (which tiers, not their directories)."""
    if cache is None:
        return "no tiers"
    on = "+".join(t for t in ("ram", "ssd") if cache.get(f"{t}_dir"))
    return f"{on} " + str({k: v for k, v in cache.items() if not k.endswith("_dir")})


def _no_corrupt(cache: dict[str, Any] | None) -> None:
    import zstore

    if cache is None:
        return
    stats = zstore.cache_stats(zstore.CacheConfig(**cache))
    for tier in ("ram", "ssd"):
        assert not (stats.get(tier) or {}).get("corrupt"), (tier, stats[tier])


def reads(seed: int, where: str, remote: bool) -> str:
    """One process, every read path; the origin modelled (latency) for 7 seeds in 10
    with ``remote``."""
    import zstore
    from zstore.testing import ModelledFileSystem

    rng = np.random.default_rng(seed)
    so = random_odd.on_s3(rng, seed)
    _, store, data, layout, options = _converted(rng, where, **so)
    cache = _cache_options(rng, where)
    fs = None
    if remote and not so and rng.random() < 0.7:
        fs = ModelledFileSystem(latency=float(rng.choice([0.0002, 0.006])))
    window = float(rng.choice([0.5, 1.0, 3.0, 8.0]))
    ds = zstore.WindowDataset(
        store,
        window_seconds=window,
        windows_per_item=int(rng.integers(1, 5)),
        seed=seed,
        cache=zstore.CacheConfig(**cache) if cache else False,
        fields=["wav", "act"],
        origin_fs=fs,
        storage_options=so.get("storage_options"),
    )
    n = 0
    for epoch, batch in ((0, 4), (0, 0), (1, 3), (2, 0), (2, 16)):
        for w in windows(ds, epoch, batch):
            check_window(w, data, layout)
            n += 1
    if cache:
        assert ds.settle(timeout=120)
    _no_corrupt(cache)
    origin = f"latency {fs.latency}" if fs else "s3" if so else "local"
    shown = {k: options[k] for k in ("chunk_seconds", "pack_seconds")}
    return f"{n} windows; {layout}, {shown}, {_tiers(cache)}, {origin}, window {window}"


def _rank(args: tuple[Any, ...]) -> int:
    """One process of :func:`ranks`: its windows of 3 epochs, each checked."""
    import torch

    import zstore

    store, data, layout, cache, window, per_item, seed, mode, latency, so, barrier = args
    warnings.simplefilter("ignore")  # as in the main process
    from zstore.testing import ModelledFileSystem

    ds = zstore.WindowDataset(
        store,
        window_seconds=window,
        windows_per_item=per_item,
        seed=seed,
        cache=zstore.CacheConfig(**cache) if cache else False,
        fields=["wav", "act"],
        origin_fs=ModelledFileSystem(latency=latency) if latency else None,
        storage_options=so,
    )
    barrier.wait()
    n = 0
    for epoch in range(3):
        if mode == "dataloader":
            ds.set_epoch(epoch)
            loader = torch.utils.data.DataLoader(
                ds, batch_size=3, num_workers=2, shuffle=True, multiprocessing_context="spawn"
            )
            got: Iterator[dict[str, Any]] = (
                {k: b[k][i] if k != "start" else float(b[k][i]) for k in b}
                for b in loader
                for i in range(len(b["item"]))
            )
        else:
            got = windows(ds, epoch, 4 if mode == "loader" else 0)
        for w in got:
            check_window(w, data, layout)
            n += 1
    return n


def ranks(seed: int, where: str, remote: bool) -> str:
    """2-3 spawned processes read one store through one node cache at once (with
    ``remote``, from a modelled origin for 7 seeds in 10: the SSD tier in use; with
    ``--s3``, 7 stores in 10 on the local S3 endpoint)."""
    rng = np.random.default_rng(seed)
    so = random_odd.on_s3(rng, seed)
    _, store, data, layout, _ = _converted(rng, where, **so)
    cache = _cache_options(rng, where) or _cache_options(np.random.default_rng(seed + 1), where)
    window = float(rng.choice([0.5, 2.0, 6.0]))
    per_item = int(rng.integers(1, 4))
    n = int(rng.integers(2, 4))
    modes = [str(rng.choice(["loader", "dataloader", "items"])) for _ in range(n)]
    latency = (
        float(rng.choice([0.0002, 0.003])) if remote and not so and rng.random() < 0.7 else 0.0
    )
    options = so.get("storage_options")
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(n)
        jobs = [
            (store, data, layout, cache, window, per_item, seed * 10 + p % 2, modes[p], latency)
            + (options, barrier)
            for p in range(n)
        ]
        with cf.ProcessPoolExecutor(n, mp_context=ctx) as pool:
            counts = list(pool.map(_rank, jobs, timeout=600))
    _no_corrupt(cache)
    origin = f"latency {latency}" if latency else "s3" if so else "local"
    return f"windows {counts} ({modes}); {layout}, {_tiers(cache)}, {origin}, window {window}"


def _recordings(rng: np.random.Generator, path: str, prefix: str) -> Data:
    """A file of 1-5 recordings under ``dev/`` and ``train/``."""
    data: Data = {}
    with h5py.File(path, "w") as f:
        for i in range(int(rng.integers(1, 6))):
            frames = int(float(rng.choice([0.3, 2.0, 7.5, 31.0])) * 100)
            if rng.random() < 0.3:
                wav = (rng.standard_normal((2, frames * 160)) * 0.1).astype(np.float32)
            else:
                wav = (rng.integers(-32768, 32768, (2, frames * 160)) / 32768).astype(np.float32)
            act = (rng.random((2, frames)) > 0.5).astype(np.float32)
            group = f"{'train' if i % 2 else 'dev'}/{prefix}{i:02d}"
            f[f"{group}/wav"], f[f"{group}/act"] = wav, act
            data[group] = {"wav": wav, "act": act}
    return data


def appends(seed: int, where: str, remote: bool) -> str:
    """2-4 files: the first ones converted (maybe only their ``dev/*``), the rest of them
    and the other files appended, some steps run twice; the store holds every item
    once, equal to its source."""
    import zstore

    rng = np.random.default_rng(seed)
    files = []
    for k in range(int(rng.integers(1, 4))):
        path = os.path.join(where, f"f{k}.h5")
        files.append((path, _recordings(rng, path, f"u{k}_")))
    so = random_odd.on_s3(rng, seed)
    store = so.pop("store", os.path.join(where, "store.zarr"))
    options: dict[str, Any] = {
        "rates": {"wav": 16000, "act": 100},
        "workers": int(rng.integers(1, 3)),
        "progress": False,
        "chunk_seconds": float(rng.choice([0.5, 1.0])),
        **so,
    }
    first = int(rng.integers(1, len(files) + 1))
    several = first > 1
    dev_only = bool(rng.random() < 0.4)
    patterns: dict[str, Any] = {"include": ["dev/*"]} if dev_only else {}
    sources = [p for p, _ in files[:first]] if several else files[0][0]
    pack = float(rng.choice([0.0, 10.0]))
    steps = 2 if rng.random() < 0.5 else 1
    for _ in range(steps):  # a rerun of a finished conversion does nothing
        zstore.convert(sources, store, pack_seconds=pack, **options, **patterns)
    want: Data = {}

    def add(k: int, only: str = "") -> None:
        for group, arrays in files[k][1].items():
            if group.startswith(only):
                want[f"f{k}/{group}" if several else group] = arrays

    for k in range(first):
        add(k, "dev/" if dev_only else "")
        if dev_only and any(g.startswith("train/") for g in files[k][1]):
            zstore.append(files[k][0], store, **options, include=["train/*"])
            add(k)
    # appended files may bring an array the store lacks (a speaker embedding), drawn
    # from a generator of its own: the seeds' other draws stay what they were
    extra = np.random.default_rng([seed, 7])
    embedded: Data = {}
    for k in range(first, len(files)):
        if extra.random() < 0.5:
            with h5py.File(files[k][0], "a") as f:
                for group in files[k][1]:
                    emb = extra.standard_normal(16).astype(np.float32)
                    f[f"{group}/emb"] = emb
                    embedded[f"f{k}/{group}" if several else group] = {"emb": emb}
        for _ in range(int(rng.integers(1, 3))):  # again: "already in the store"
            zstore.append(files[k][0], store, **options)
        add(k)
    if embedded:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the items without it, left out
            ds = zstore.WindowDataset(
                store, window_seconds=None, fields=["emb"], missing="skip", cache=False, **so
            )
        got = {ds[i]["item"]: ds[i]["emb"].numpy() for i in range(len(ds))}
        assert set(got) == set(embedded), ("emb", sorted(set(got) ^ set(embedded)))
        for item, arrays in embedded.items():
            assert np.array_equal(got[item], arrays["emb"]), (item, "emb")
    ds = zstore.WindowDataset(store, window_seconds=None, fields=["wav", "act"], cache=False, **so)
    seen: set[str] = set()
    for i in range(len(ds)):
        w = ds[i]
        assert w["item"] not in seen, ("twice", w["item"])
        assert w["item"] in want, ("not a source item", w["item"])
        seen.add(w["item"])
        for name in ("wav", "act"):
            assert np.array_equal(w[name].numpy(), want[w["item"]][name]), (w["item"], name)
    assert seen == set(want), ("missing", sorted(set(want) - seen))
    on = ", on S3" if so else ""
    brought = f", {len(embedded)} with an appended array" if embedded else ""
    return (
        f"{len(want)} items from {len(files)} files{on}, {first} converted, "
        f"dev only {dev_only}{brought}"
    )


def _stored_items(store: str, storage_options: dict[str, Any] | None = None) -> Data:
    """Every item of ``store`` whole, by name (an item twice fails)."""
    import zstore

    ds = zstore.WindowDataset(
        store,
        window_seconds=None,
        fields=["wav", "act"],
        cache=False,
        storage_options=storage_options,
    )
    got: Data = {}
    for i in range(len(ds)):
        w = ds[i]
        assert w["item"] not in got, ("twice", w["item"])
        got[w["item"]] = {name: w[name].numpy() for name in ("wav", "act")}
    return got


def _files_in(path: str) -> int:
    if path.startswith("s3://"):  # a store on the local S3 endpoint (--s3)
        import fsspec

        fs, root = fsspec.core.url_to_fs(path, **(random_odd.S3_OPTIONS or {}))
        fs.invalidate_cache()  # s3fs keeps listings: a count must see new objects
        return len(fs.find(root))
    return sum(len(names) for _, _, names in os.walk(path))


def _killed_run(code: str, into: str | list[str], after: float) -> str:
    """Run ``code`` in a process of its own and kill it (SIGKILL, its process group)
    ``after`` seconds after it first writes a file under ``into`` (a directory or an S3
    URL, or several); what happened, in words."""
    paths = [into] if isinstance(into, str) else into
    before = sum(_files_in(p) for p in paths)
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    while proc.poll() is None and sum(_files_in(p) for p in paths) <= before:  # until it writes
        time.sleep(0.002)
    try:
        proc.wait(timeout=after)
        return "finished first"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _unlink_leaked_semaphores(proc.pid, started)
        now = sum(_files_in(p) for p in paths)
        return f"killed {after:.2f} s into its writes ({now - before} files)"


def _unlink_leaked_semaphores(group: int, since: float) -> None:
    """Remove the named semaphores of a process group killed with SIGKILL: the
    converter's worker pool makes some (``/dev/shm/sem.mp-*``), and multiprocessing's
    resource tracker, killed with the group, is what would have unlinked them (each run
    of the suite left 18, until a reboot).  Once every process of the group has ended,
    those made since ``since`` that no live process maps."""
    while True:  # SIGKILL is delivered at once, but each process ends in its own time
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            break
        except PermissionError:
            return
        time.sleep(0.01)
    shm = "/dev/shm"
    try:
        names = [n for n in os.listdir(shm) if n.startswith("sem.mp-")]
    except OSError:
        return
    fresh = []
    for name in names:
        try:
            if os.stat(os.path.join(shm, name)).st_mtime >= since - 1:
                fresh.append(name)
        except OSError:
            pass
    if not fresh:
        return
    mapped: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                mapped.update(
                    line.split(shm + "/", 1)[1].split()[0] for line in f if shm + "/sem." in line
                )
        except OSError:
            pass
    for name in fresh:
        if name not in mapped:
            try:
                os.unlink(os.path.join(shm, name))
            except OSError:
                pass


def _stale_lock_named(store: str, code: str) -> bool:
    """On S3: a run after a kill names the lock the killed process left (at once, it is
    of this host) and that object is then deleted, as its error says to; whether there
    was one."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(store, **(random_odd.S3_OPTIONS or {}))
    fs.invalidate_cache()
    if not fs.exists(f"{root}/zstore.lock"):
        return False
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode != 0 and "no longer running" in run.stderr, run.stderr[-3000:]
    fs.rm_file(f"{root}/zstore.lock")
    return True


def kills(seed: int, where: str, remote: bool) -> str:
    """A conversion or an append killed (SIGKILL, its process group) at a random moment
    once it writes (and its rerun, now and then, too), then run again to its end: the
    store holds every item once, equal to its source.  ``--s3``: the store on the local
    S3 endpoint for 7 seeds in 10, where a killed run leaves its lock object: the next
    run must name it at once, and it is deleted as the error says.  A local store keeps
    none of the files the killed writes left (``*.partial``) where the rerun writes."""
    rng = np.random.default_rng(seed)
    files = []
    for k in range(2):
        path = os.path.join(where, f"f{k}.h5")
        files.append((path, _recordings(rng, path, f"u{k}_")))
    so = random_odd.on_s3(rng, seed)
    store = so.get("store") or os.path.join(where, "store.zarr")
    options = f", storage_options={so['storage_options']!r}" if so else ""
    workers = int(rng.integers(1, 3))
    append = bool(rng.random() < 0.5)
    args = (
        f"zstore.append({files[1][0]!r}, {store!r}, rates={{'wav': 16000, 'act': 100}}, "
        f"workers={workers}, progress=False{options})"
        if append
        else f"zstore.convert({[p for p, _ in files]!r}, {store!r}, rates={{'wav': 16000, "
        f"'act': 100}}, workers={workers}, progress=False, pack_seconds=0{options})"
    )
    if append:
        import zstore

        zstore.convert(
            files[0][0],
            store,
            rates={"wav": 16000, "act": 100},
            workers=1,
            progress=False,
            storage_options=so.get("storage_options"),
        )
    code = f"import zstore; {args}"
    span = 2.0 if so else 0.12  # on S3 the lock is written long before the items
    killed = [_killed_run(code, store, float(rng.uniform(0.0, span)))]
    stale = so and _stale_lock_named(store, code)
    if rng.random() < 0.3:  # the rerun killed too
        killed.append(_killed_run(code, store, float(rng.uniform(0.0, span))))
        stale = (so and _stale_lock_named(store, code)) or stale
    # its workers went with it (its process group); the rerun takes the store's lock
    rerun = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    want = {}
    for k, (_, data) in enumerate(files):  # one file converted: items named by group
        want.update(data if append else {f"f{k}/{g}": v for g, v in data.items()})
    got = _stored_items(store, so.get("storage_options"))
    assert set(got) == set(want), ("items", sorted(set(want) ^ set(got)))
    for item, arrays in want.items():
        for name in ("wav", "act"):
            assert np.array_equal(got[item][name], arrays[name]), (item, name)
    if not so:  # the rerun removed what the killed writes left where it writes
        left = [
            os.path.relpath(os.path.join(here, n), store)
            for here, _, names in os.walk(store)
            for n in names
            if n.endswith(".partial")
        ]
        if append:  # the root's own files and item tables are tidy's (zstore tidy)
            left = [p for p in left if "/" in p and not p.startswith("zstore_items_")]
        assert not left, ("left by the killed writes", left)
    what = "append" if append else "convert"
    on = f", on S3{' (its lock left, named, deleted)' if stale else ''}" if so else ""
    return f"{what} of {len(want)} items, {workers} worker(s){on}, {'; '.join(killed)}; run again"


def reader_kills(seed: int, where: str, remote: bool) -> str:
    """A process reading through a node cache killed (SIGKILL) at a random moment once
    it writes into the tiers, then every window read through the same tiers: each equals
    its source (a value the killed process left half-written is never served)."""
    import zstore
    from zstore.testing import ModelledFileSystem

    rng = np.random.default_rng(seed)
    so = random_odd.on_s3(rng, seed)
    _, store, data, layout, _ = _converted(rng, where, **so)
    cache = _cache_options(rng, where) or _cache_options(np.random.default_rng(seed + 1), where)
    if cache is None:
        cache = {"ram_dir": os.path.join(where, "ram"), "ram_bytes": "64MB"}
    window = float(rng.choice([0.5, 2.0, 6.0]))
    per_item = int(rng.integers(1, 4))
    latency = float(rng.choice([0.0, 0.0002]))  # a modelled origin: the SSD tier in use
    latency = 0.0 if so else latency  # S3 is remote already
    options = so.get("storage_options")
    settings = (
        f"window_seconds={window}, windows_per_item={per_item}, fields=['wav', 'act'], "
        f"storage_options={options!r}"
    )
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import zstore\n"
        "from zstore.testing import ModelledFileSystem\n"
        f"fs = ModelledFileSystem(latency={latency}) if {latency} else None\n"
        f"ds = zstore.WindowDataset({store!r}, cache=zstore.CacheConfig(**{cache!r}), "
        f"seed={seed}, origin_fs=fs, {settings})\n"
        "for epoch in range(4):\n"
        "    loader = zstore.WindowLoader(ds, batch_size=4, shuffle=True)\n"
        "    loader.set_epoch(epoch)\n"
        "    for batch in loader:\n"
        "        pass\n"
    )
    tiers = [d for d in (cache.get("ram_dir"), cache.get("ssd_dir")) if d]
    killed = _killed_run(code, tiers, float(rng.uniform(0.0, 0.3)))
    ds = zstore.WindowDataset(
        store,
        window_seconds=window,
        windows_per_item=per_item,
        seed=seed,
        cache=zstore.CacheConfig(**cache),
        fields=["wav", "act"],
        origin_fs=ModelledFileSystem(latency=latency) if latency else None,
        storage_options=options,
    )
    n = 0
    for epoch, batch in ((0, 4), (1, 0), (2, 3), (3, 0)):
        for w in windows(ds, epoch, batch):
            check_window(w, data, layout)
            n += 1
    assert ds.settle(timeout=120)
    origin = f"latency {latency}" if latency else "s3" if so else "local"
    return f"{n} windows after a reader {killed}; {layout}, {_tiers(cache)}, {origin}"


KINDS: dict[str, Callable[[int, str, bool], str]] = {
    "reads": reads,
    "ranks": ranks,
    "appends": appends,
    "kills": kills,
    "reader-kills": reader_kills,
    "odd": lambda seed, where, remote: random_odd.odd(seed, where, remote),
    "overwrites": lambda seed, where, remote: random_overwrites.overwrites(seed, where, remote),
    "copies": lambda seed, where, remote: random_copies.copies(seed, where, remote),
}


def s3_endpoint() -> tuple[Any, dict[str, Any]]:
    """A local S3 endpoint (moto's server on a free port of 127.0.0.1) with a bucket
    ``zstore-random``: (the server, to stop; s3fs's storage options)."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": url, "region_name": "us-east-1"},
    }
    boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket="zstore-random")
    return server, options


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kind", choices=sorted(KINDS))
    p.add_argument("--seeds", default="0:100", help="a range A:B of seeds (default 0:100)")
    p.add_argument("--remote", action="store_true", help="reads, ranks: a modelled origin too")
    p.add_argument("--work", default=None, help="where the corpora go (default: a temp dir)")
    p.add_argument(
        "--s3",
        action="store_true",
        help="reads, odd: stores on a local S3 endpoint (moto), 7 in 10",
    )
    args = p.parse_args(argv)
    server = None
    if args.s3:
        server, random_odd.S3_OPTIONS = s3_endpoint()
    first, stop = (int(x) for x in args.seeds.split(":"))
    warnings.simplefilter("ignore")  # short items padded, precision notes: all expected
    work = args.work or tempfile.mkdtemp(prefix="zstore-random-")
    failures = 0
    for seed in range(first, stop):
        where = os.path.join(work, str(seed))
        shutil.rmtree(where, ignore_errors=True)
        os.makedirs(where)
        try:
            print(f"seed {seed}: ok,", KINDS[args.kind](seed, where, args.remote), flush=True)
            shutil.rmtree(where, ignore_errors=True)
        except Exception:
            failures += 1
            print(f"seed {seed}: FAILED (its files are in {where})", flush=True)
            traceback.print_exc()
    print(f"{args.kind}: {stop - first - failures} of {stop - first} seeds passed", flush=True)
    if not args.work and not failures:  # a failing seed's files stay for a look
        shutil.rmtree(work, ignore_errors=True)
    if server is not None:
        server.stop()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
