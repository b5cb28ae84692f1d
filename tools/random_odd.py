"""The ``odd`` kind of tools/random_corpora.py: HDF5 files as they come, converted and
read back through zstore, every array equal to h5py's.

Each seed writes a file of 2-6 recordings (``wav`` channels x samples at 16 kHz,
int16-valued or true float with now and then a NaN or infinity; ``act`` at 100 frames/s)
with random odd features:

- arrays in some groups only (an 8-value embedding ``emb``), a scalar ``label`` in each;
- a transcript as a string dataset (kept as an attribute of its item);
- a dimension scale (``frame_time``, float64) attached to ``act``;
- a soft link to the group's own ``wav`` (``mic0``: the same values under another name);
- a group hard-linked under a second name (converted once, under the first name in name
  order), a soft link to a group, a dangling external link;
- a subgroup of features (``feats/mfcc``, frames first: ``--subgroups arrays``);
- int32 ``phones`` and bool ``vad`` at 100 frames/s, a compound ``segments`` table
  (one array per field), a complex64 array stored whole;
- ``wav`` as a virtual dataset joining two halves in another file, ``act`` in external
  raw storage;
- HDF5 filters and chunking on the datasets (gzip, lzf, fletcher32);
- attributes with NaN, infinity, text, arrays and no value (``h5py.Empty``), and a
  rate attribute ``sr`` on ``wav``;
- now and then a second file of the same kind appended (twice: the rerun adds nothing).

The store must hold exactly the recordings (one per hard-linked group) and, for each, its
numeric datasets, each read whole through ``WindowDataset(window_seconds=None)`` equal to
h5py bit for bit (dtype and shape included); ``items=`` callables see the NaN and
infinite attributes as floats; windows of ``wav`` and ``act`` (and ``label``, stacked)
read through random tiers with ``WindowLoader`` and ``ds[i]`` equal their source.
``--s3`` puts 7 stores in 10 on the local S3 endpoint.
"""

from __future__ import annotations

import os
from typing import Any

import h5py
import numpy as np

STORAGE: list[dict[str, Any]] = [
    {},
    {"chunks": True},
    {"chunks": True, "compression": "gzip", "shuffle": True},
    {"chunks": True, "compression": "lzf"},
    {"chunks": True, "fletcher32": True},
]

Arrays = dict[str, np.ndarray]
#: s3fs's options for a local S3 endpoint with a bucket ``zstore-random`` (``--s3``)
S3_OPTIONS: dict[str, Any] | None = None


FEATURES = (
    "true_float", "emb", "label", "text", "scale", "mic_link", "feats", "nested",
    "phones", "vad", "segments", "complex", "vds", "external", "links",
)  # fmt: skip


def features(rng: np.random.Generator) -> dict[str, Any]:
    """Which odd features a corpus has (the same for a file appended to it)."""
    got: dict[str, Any] = {name: bool(rng.random() < 0.35) for name in FEATURES}
    got["hard"] = str(rng.choice(["none", "aa_copy", "zz_copy"]))
    got["channels"] = int(rng.integers(1, 3))
    got["storage"] = int(rng.integers(len(STORAGE)))
    return got


def odd_file(
    rng: np.random.Generator, path: str, feat: dict[str, Any], first: int = 0
) -> tuple[dict[str, Arrays], dict[str, Any]]:
    """A random HDF5 file at ``path`` with the odd features ``feat`` (items numbered
    from ``first``): ({item: {array name in the store: values}}, the convert options
    it needs)."""
    n_items = int(rng.integers(2, 7))
    true_float, emb, label, text = feat["true_float"], feat["emb"], feat["label"], feat["text"]
    scale, mic_link, feats, nested = feat["scale"], feat["mic_link"], feat["feats"], feat["nested"]
    hard, channels = feat["hard"] if first == 0 else "none", feat["channels"]
    storage = dict(STORAGE[feat["storage"]])
    want: dict[str, Arrays] = {}
    parts = os.path.join(os.path.dirname(path), f"parts{first}.h5")
    with h5py.File(path, "w") as f:
        names = []
        for i in range(first, first + n_items):
            name = f"spk{i % 2}/rec_{i:02d}" if nested else f"rec_{i:02d}"
            names.append(name)
            g = f.create_group(name)
            frames = int(float(rng.choice([0.3, 1.0, 2.5, 7.3, 19.9, 33.0])) * 100)
            n = frames * 160
            if true_float:
                wav = (rng.standard_normal((channels, n)) * 0.1).astype(np.float32)
                if rng.random() < 0.3:
                    wav.flat[int(rng.integers(wav.size))] = rng.choice([np.nan, np.inf, -0.0])
            else:
                wav = (rng.integers(-32768, 32768, (channels, n)) / 32768).astype(np.float32)
            if feat["vds"] and i % 2 == first % 2:  # halves in another file, joined
                _virtual(g, "wav", wav, parts, f"{name}/wav")
            else:
                g.create_dataset("wav", data=wav, **_options(storage, wav.shape))
            g["wav"].attrs["sr"] = 16000
            g["wav"].attrs["gain"] = np.nan
            g.attrs["gain"] = float(rng.choice([np.nan, np.inf, 0.5]))
            g.attrs["speaker"] = f"spk{i % 2}"
            g.attrs["offsets"] = np.arange(3, dtype=np.int32)
            g.attrs["nothing"] = h5py.Empty("f")
            act = (rng.random((2, frames)) > 0.5).astype(np.float32)
            if feat["external"] and i % 2:  # raw bytes in a file of their own
                raw = os.path.join(os.path.dirname(path), f"act{i}.bin")
                act.tofile(raw)
                g.create_dataset(
                    "act", shape=act.shape, dtype=act.dtype, external=[(raw, 0, act.nbytes)]
                )
            else:
                g["act"] = act
            arrays: Arrays = {"wav": wav, "act": act}
            if feat["phones"]:
                phones = rng.integers(0, 40, frames).astype(np.int32)
                g.create_dataset("phones", data=phones, **_options(storage, phones.shape))
                arrays["phones"] = phones
            if feat["vad"]:
                arrays["vad"] = g["vad"] = rng.random(frames) > 0.5
            if feat["segments"]:
                rows = int(rng.integers(1, 5))
                table = np.zeros(rows, dtype=[("start", "<f8"), ("end", "<f8"), ("spk", "<i4")])
                table["start"] = np.sort(rng.random(rows))
                table["end"], table["spk"] = table["start"] + 0.5, rng.integers(0, 3, rows)
                g["segments"] = table
                for field in ("start", "end", "spk"):
                    arrays[f"segments.{field}"] = table[field].copy()
            if feat["complex"]:
                z = (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64)
                arrays["tf"] = g["tf"] = z
            if emb and (i % 3 != 1):  # some groups lack it
                arrays["emb"] = g["emb"] = rng.standard_normal(8).astype(np.float32)
            if label:
                g["label"] = np.int64(i)
                arrays["label"] = np.asarray(np.int64(i))
            if text:
                g["text"] = f"utterance {i}"
            if scale:
                g["frame_time"] = np.arange(frames) / 100.0
                g["frame_time"].make_scale("time")
                g["act"].dims[1].attach_scale(g["frame_time"])
                arrays["frame_time"] = np.arange(frames) / 100.0
            if mic_link:
                g["mic0"] = h5py.SoftLink(f"/{name}/wav")
                arrays["mic0"] = wav
            if feats:
                mfcc = rng.standard_normal((frames, 13)).astype(np.float32)
                g["feats/mfcc"] = mfcc
                g["feats"].attrs["kind"] = "mfcc"
                arrays["feats.mfcc"] = mfcc
            want[name] = arrays
        if hard != "none":
            head = names[0]
            f[hard] = f[head]  # a second name of the same group
            if hard < head:  # converted under its first name in name order
                want[hard] = want.pop(head)
        if feat["links"]:
            f[f"alias{first}"] = h5py.SoftLink(f"/{names[-1]}")
            f[f"elsewhere{first}"] = h5py.ExternalLink("no-such-file.h5", "/x")
    options: dict[str, Any] = {"rates": {"wav": 16000, "act": 100}}
    if feat["phones"]:
        options["rates"]["phones"] = 100
    if feat["vad"]:
        options["rates"]["vad"] = 100
    if feats:
        options["subgroups"] = "arrays"
        options["rates"]["feats.mfcc"] = 100
        options["time_axis"] = {"feats.mfcc": 0}
    if mic_link:
        options["rates"]["mic0"] = 16000
    return want, options


def _options(storage: dict[str, Any], shape: tuple[int, ...]) -> dict[str, Any]:
    """h5py dataset options: ``storage`` with chunks that fit ``shape``."""
    if not storage or not all(shape):
        return {}
    return {**storage, "chunks": tuple(max(1, min(n, 4001)) for n in shape)}


def _virtual(g: Any, name: str, values: np.ndarray, parts: str, key: str) -> None:
    """Dataset ``name`` of ``g`` as a virtual dataset joining two halves along time,
    each a dataset ``key/0``, ``key/1`` of the file ``parts`` (named by its file name:
    found beside the file that uses it)."""
    half = values.shape[-1] // 2
    pieces = (values[..., :half], values[..., half:])
    with h5py.File(parts, "a") as f:
        for k, piece in enumerate(pieces):
            f[f"{key}/{k}"] = piece
    layout = h5py.VirtualLayout(shape=values.shape, dtype=values.dtype)
    at = 0
    for k, piece in enumerate(pieces):
        n = piece.shape[-1]
        source = h5py.VirtualSource(os.path.basename(parts), f"{key}/{k}", shape=piece.shape)
        layout[..., at : at + n] = source
        at += n
    g.create_virtual_dataset(name, layout, fillvalue=0)


def on_s3(rng: np.random.Generator, seed: int) -> dict[str, Any]:
    """With ``--s3``, for 7 seeds in 10: ``{"store": an S3 URL, "storage_options": ...}``
    for a store on the local S3 endpoint; else nothing."""
    if S3_OPTIONS is None or rng.random() >= 0.7:
        return {}
    return {
        "store": f"s3://zstore-random/{seed}-{os.getpid()}/store.zarr",
        "storage_options": S3_OPTIONS,
    }


def same(got: np.ndarray, want: np.ndarray, where: tuple[Any, ...]) -> None:
    """Bit for bit, dtype and shape included."""
    want = np.asarray(want)
    assert got.dtype == want.dtype, (*where, "dtype", got.dtype, want.dtype)
    assert got.shape == want.shape, (*where, "shape", got.shape, want.shape)
    a, b = np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(want).view(np.uint8)
    assert np.array_equal(a, b), (*where, "values")


def odd(seed: int, where: str, remote: bool) -> str:
    """One seed of the ``odd`` kind (see the module)."""
    from random_corpora import _cache_options, _no_corrupt, _tiers, windows

    import zstore
    from zstore.testing import ModelledFileSystem

    rng = np.random.default_rng(seed)
    feat = features(rng)
    h5 = os.path.join(where, "odd.h5")
    want, options = odd_file(rng, h5, feat)
    store = os.path.join(where, "store.zarr")
    options.update(workers=int(rng.integers(1, 3)), progress=False)
    so = on_s3(rng, seed)
    store = so.pop("store", store)
    options.update(so)
    report = zstore.convert(
        h5,
        store,
        chunk_seconds=float(rng.choice([0.5, 1.0, 4.0])),
        pack_seconds=float(rng.choice([0.0, 10.0, 30.0])),
        **options,
    )
    appended = rng.random() < 0.4
    if appended:  # a second file of the same kind, added to the store (twice: a rerun)
        more, _ = odd_file(rng, os.path.join(where, "more.h5"), feat, first=10)
        for _ in range(int(rng.integers(1, 3))):
            zstore.append(os.path.join(where, "more.h5"), store, **options)
        want.update(more)
    info = zstore.store_info(store, **so)
    pairs = {(item, name) for item, arrays in want.items() for name in arrays}
    seen: set[tuple[str, str]] = set()
    for name in info["arrays"]:
        ds = zstore.WindowDataset(
            store, window_seconds=None, fields=[name], missing="skip", cache=False, **so
        )
        for i in range(len(ds)):
            w = ds[i]
            item = w["item"]
            assert (item, name) in pairs, ("not in the source", item, name)
            assert (item, name) not in seen, ("twice", item, name)
            seen.add((item, name))
            same(w[name].numpy(), want[item][name], (item, name))
    assert seen == pairs, ("missing", sorted(pairs - seen))

    texts = {}  # each item's transcript, as h5py reads it (a hard link: its group's)
    for h5_file in (h5, os.path.join(where, "more.h5")) if appended else (h5,):
        with h5py.File(h5_file, "r") as f:
            for item in want:
                if item in f and "text" in f[item]:
                    texts[item] = f[item]["text"].asstr()[()]
    attrs: dict[str, dict[str, Any]] = {}

    def keep(item: str, a: dict[str, Any]) -> bool:
        attrs[item] = a
        return True

    zstore.WindowDataset(store, window_seconds=1.0, items=keep, cache=False, **so)
    assert set(attrs) == set(want), ("items= saw", sorted(set(attrs) ^ set(want)))
    for item, a in attrs.items():
        gain = a.get("gain")
        assert isinstance(gain, float), (item, "gain", gain)
        if feat["text"]:  # the string dataset, as an attribute
            assert a.get("text") == texts.get(item), (item, "text", a.get("text"))

    cache = _cache_options(rng, where)
    fs = ModelledFileSystem(latency=0.0002) if remote and not so and rng.random() < 0.7 else None
    fields = ["wav", "act"] + (["label"] if "label" in info["arrays"] else [])
    window = float(rng.choice([0.5, 1.0, 3.0]))
    ds = zstore.WindowDataset(
        store,
        window_seconds=window,
        windows_per_item=int(rng.integers(1, 4)),
        seed=seed,
        cache=zstore.CacheConfig(**cache) if cache else False,
        fields=fields,
        origin_fs=fs,
        **so,
    )
    n = 0
    for epoch, batch in ((0, 4), (1, 0), (2, 3)):
        for w in windows(ds, epoch, batch, tuple(fields)):
            src = want[w["item"]]
            start, frames = round(w["start"] * 100), int(w["length"])
            where_ = (w["item"], round(w["start"], 3), frames)
            wav = w["wav"].numpy()
            same(
                wav[:, : frames * 160], src["wav"][:, start * 160 : (start + frames) * 160], where_
            )
            assert not wav[:, frames * 160 :].any(), (*where_, "wav padding")
            act = w["act"].numpy()
            same(act[:, :frames], src["act"][:, start : start + frames], where_)
            assert not act[:, frames:].any(), (*where_, "act padding")
            if "label" in fields:
                same(w["label"].numpy(), src["label"], (*where_, "label"))
            n += 1
    if cache:
        assert ds.settle(timeout=120)
    _no_corrupt(cache)
    on = sorted(k for k, v in feat.items() if v is True)
    return (
        f"{len(want)} items{' (appended)' if appended else ''}, {on}, hard link "
        f"{feat['hard']}, storage {feat['storage']}, {len(report.skipped)} skipped; "
        f"{n} windows of {window} s, "
        f"{_tiers(cache)}, {'s3' if so else 'latency' if fs else 'local'}"
    )
