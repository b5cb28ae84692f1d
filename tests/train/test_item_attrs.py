"""``WindowDataset.item_attrs``: an item's HDF5 attributes (speaker, transcript, gain),
by index, ``(epoch, index)`` pair or name, for packed and unpacked items alike."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch
from conftest import write_h5

import zstore


def _corpus(path) -> dict[str, dict]:
    """Short utterances (packed) and long recordings (a group each), with the
    attributes speech corpora keep: text, numbers, a NaN, an array, bytes."""
    rng = np.random.default_rng(0)
    items, attrs = {}, {}
    for i, seconds in enumerate([2, 3, 40, 2.5, 35]):
        name = f"spk{i % 2}/utt{i}"
        n = int(16000 * seconds)
        items[name] = {"wav": rng.integers(-3000, 3000, (1, n)).astype(np.float32)}
        attrs[name] = {
            "speaker": f"spk{i % 2}",
            "text": f"utterance number {i} — ünïcödé",
            "gain_db": float(i) - 1.5,
            "snr": float("nan") if i == 3 else 20.0 + i,
            "channels": np.arange(i + 1),
            "corpus": b"dev",
        }
    write_h5(path, items, attrs)
    return attrs


def _expected(a: dict) -> dict:
    return {
        "speaker": a["speaker"],
        "text": a["text"],
        "gain_db": a["gain_db"],
        "snr": a["snr"],
        "channels": a["channels"].tolist(),
        "corpus": "dev",
    }


def _same(got: dict, want: dict) -> bool:
    nan = isinstance(want["snr"], float) and math.isnan(want["snr"])
    if nan and not math.isnan(got.get("snr", 0.0)):
        return False
    strip = {k: v for k, v in got.items() if not (nan and k == "snr")}
    return strip == {k: v for k, v in want.items() if not (nan and k == "snr")}


def test_item_attrs_by_index_pair_and_name(tmp_path):
    attrs = _corpus(tmp_path / "c.h5")
    store = str(tmp_path / "c.zarr")
    report = zstore.convert(
        str(tmp_path / "c.h5"), store, rates={"wav": 16000}, workers=1, progress=False
    )
    assert report.packed == 3  # the short ones; the long ones keep a group each
    ds = zstore.WindowDataset(store, window_seconds=1.0, windows_per_item=2, cache=False)
    assert len(ds) == 10
    for i in range(len(ds)):
        name = ds[i]["item"]
        want = _expected(attrs[name])
        assert _same(ds.item_attrs(i), want), (i, name, ds.item_attrs(i))
        assert _same(ds.item_attrs((3, i)), want)
        assert _same(ds.item_attrs(name), want)
        assert not any(k.startswith("zstore") for k in ds.item_attrs(i))
    subset = zstore.WindowDataset(
        store, window_seconds=1.0, items=["spk0/utt4", "spk1/utt1"], cache=False
    )
    assert _same(subset.item_attrs(0), _expected(attrs["spk0/utt4"]))
    assert _same(subset.item_attrs(1), _expected(attrs["spk1/utt1"]))
    assert _same(subset.item_attrs("spk0/utt2"), _expected(attrs["spk0/utt2"]))  # any item
    copy = pickle.loads(pickle.dumps(ds))  # as a DataLoader worker gets it
    assert _same(copy.item_attrs(4), _expected(attrs[ds[4]["item"]]))
    with pytest.raises(IndexError, match="index 10 out of range for 10 windows"):
        ds.item_attrs(10)
    with pytest.raises(KeyError, match="no item is named 'utt9'.*named like 'spk"):
        ds.item_attrs("utt9")


def test_item_attrs_beside_a_loaders_batches(tmp_path, cache):
    """A batch names its items; their attributes are a lookup away, through the tiers."""
    attrs = _corpus(tmp_path / "c.h5")
    store = str(tmp_path / "c.zarr")
    zstore.convert(str(tmp_path / "c.h5"), store, rates={"wav": 16000}, workers=1, progress=False)
    ds = zstore.WindowDataset(store, window_seconds=1.0, cache=cache)
    loader = zstore.WindowLoader(ds, batch_size=2, shuffle=True)
    seen = set()
    for batch in loader:
        for name in batch["item"]:
            assert _same(ds.item_attrs(name), _expected(attrs[name]))
            seen.add(name)
    assert seen == set(attrs)


def test_attrs_come_with_each_window_and_batch(tmp_path, cache):
    """``attrs=`` adds item attributes to each window, and to a WindowLoader batch
    collated as torch's DataLoader collates them: the same batch from either."""
    attrs = _corpus(tmp_path / "c.h5")
    store = str(tmp_path / "c.zarr")
    zstore.convert(str(tmp_path / "c.h5"), store, rates={"wav": 16000}, workers=1, progress=False)
    ds = zstore.WindowDataset(
        store, window_seconds=1.0, attrs=["speaker", "gain_db", "text"], cache=cache
    )
    for i in range(len(ds)):
        w = ds[i]
        want = attrs[w["item"]]
        assert (w["speaker"], w["gain_db"], w["text"]) == (
            want["speaker"],
            want["gain_db"],
            want["text"],
        )
    ours = next(iter(zstore.WindowLoader(ds, batch_size=5)))
    torch_batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=5)))
    assert ours["item"] == torch_batch["item"]
    for key in ("speaker", "text"):
        assert ours[key] == torch_batch[key] == [attrs[n][key] for n in ours["item"]]
    assert ours["gain_db"].dtype == torch_batch["gain_db"].dtype == torch.float64
    assert ours["gain_db"].tolist() == [attrs[n]["gain_db"] for n in ours["item"]]
    copy = pickle.loads(pickle.dumps(ds))  # as a DataLoader worker gets it
    assert copy[3]["speaker"] == ds[3]["speaker"]


def test_attrs_an_item_lacks_or_that_would_replace_a_key(tmp_path):
    _corpus(tmp_path / "c.h5")
    store = str(tmp_path / "c.zarr")
    zstore.convert(str(tmp_path / "c.h5"), store, rates={"wav": 16000}, workers=1, progress=False)
    ds = zstore.WindowDataset(store, window_seconds=1.0, attrs=["accent"], cache=False)
    first = ds.locate(0)[0]
    with pytest.raises(KeyError, match=f"item '{first}' has no attribute 'accent'.*'speaker'"):
        ds[0]
    with pytest.raises(zstore.LoaderError, match="no attribute 'accent'"):
        next(iter(zstore.WindowLoader(ds, batch_size=2)))
    for taken in ("wav", "item", "length"):
        with pytest.raises(zstore.ConfigError, match=f"attrs \\['{taken}'\\] would replace"):
            zstore.WindowDataset(store, window_seconds=1.0, attrs=[taken], cache=False)


def test_a_transform_that_changes_an_attribute_changes_no_later_window(tmp_path):
    _corpus(tmp_path / "c.h5")
    store = str(tmp_path / "c.zarr")
    zstore.convert(str(tmp_path / "c.h5"), store, rates={"wav": 16000}, workers=1, progress=False)

    def grow(w):
        w["channels"].append(99)  # in place
        return w

    ds = zstore.WindowDataset(
        store, window_seconds=1.0, attrs=["channels"], transform=grow, cache=False
    )
    assert ds[0]["channels"] == ds[0]["channels"] == [*range(len(ds[0]["channels"]) - 1), 99]


def test_whole_utterances_with_their_transcripts(tmp_path):
    """ASR on whole utterances: ``window_seconds=None``, ``attrs=["text"]`` and
    ``collate_pad`` give padded audio, its lengths and the transcripts, in one batch."""
    attrs = _corpus(tmp_path / "c.h5")
    store = str(tmp_path / "c.zarr")
    zstore.convert(str(tmp_path / "c.h5"), store, rates={"wav": 16000}, workers=1, progress=False)
    ds = zstore.WindowDataset(store, window_seconds=None, attrs=["text"], cache=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=5, collate_fn=zstore.collate_pad)
    batch = next(iter(loader))
    assert batch["text"] == [attrs[n]["text"] for n in batch["item"]]
    assert batch["wav_length"].tolist() == [ds[i]["wav"].shape[-1] for i in range(5)]


def test_attributes_of_many_records_read_in_random_order(tmp_path, monkeypatch):
    """Packed utterances in several batch records, their attributes of every kind (a
    transcript, whole numbers, one beyond int64 (uint64), floats with a NaN, booleans, lists, a
    mix of whole and fractional numbers, one that only some items have), read in random
    order, with the process's columns held to a few records so they are let go of and
    read again: each item's own attributes every time, and a list changed by the caller
    changes no later read."""
    import importlib

    columns = importlib.import_module("zstore.read._record_columns")
    rng = np.random.default_rng(5)
    items, attrs = {}, {}
    for i in range(1500):
        name = f"spk{i % 7}/utt{i:05d}"
        items[name] = {"wav": rng.integers(-3000, 3000, (1, 1600 + i % 50)).astype(np.int16)}
        attrs[name] = {
            "text": f"utterance {i} — ünïcödé" * (1 + i % 3),
            "spk_id": i % 7,
            "big": np.uint64(2**63 + i),
            "snr": float("nan") if i % 11 == 0 else 0.5 * i,
            "clean": i % 2 == 0,
            "tags": np.arange(i % 4),
            "gain": i if i % 2 else i + 0.25,
        }
        if i % 5 == 0:
            attrs[name]["note"] = f"note {i}"
    write_h5(tmp_path / "c.h5", items, attrs)
    store = tmp_path / "c.zarr"
    zstore.convert(  # short chunks: a batch record of a few hundred items
        tmp_path / "c.h5", store, rates={"wav": 16000}, chunk_seconds=0.1, workers=1, progress=False
    )
    assert len(list(store.glob("zstore_packed/*/items.*.json"))) >= 3
    monkeypatch.setattr(columns, "MAX_COLUMN_BYTES", 4000)

    def want(name: str) -> dict:
        a = dict(attrs[name])
        a["tags"] = a["tags"].tolist()
        a["clean"] = bool(a["clean"])
        a["big"] = int(a["big"])
        return a

    def same(got: dict, name: str) -> bool:
        w = want(name)
        if math.isnan(w["snr"]):
            if not math.isnan(got.pop("snr")):
                return False
            w.pop("snr")
        return got == w and all(type(got[k]) is type(w[k]) for k in w)

    ds = zstore.WindowDataset(
        store, window_seconds=0.05, attrs=["text", "spk_id", "snr"], cache=False, seed=1
    )
    order = rng.permutation(len(ds))
    for i in order[:600]:
        window = ds[int(i)]
        name = window["item"]
        assert window["text"] == attrs[name]["text"] and window["spk_id"] == attrs[name]["spk_id"]
        got = ds.item_attrs(int(i))
        assert same(got, name), (name, got)
    name = ds[int(order[0])]["item"]
    ds.item_attrs(name)["tags"].append(99)
    assert ds.item_attrs(name)["tags"] == want(name)["tags"]
    for batch in zstore.WindowLoader(ds, batch_size=64, shuffle=True):
        assert batch["text"] == [attrs[n]["text"] for n in batch["item"]]
        assert batch["spk_id"].tolist() == [attrs[n]["spk_id"] for n in batch["item"]]


def test_transcripts_of_packed_items_on_s3_in_dataloader_workers(s3, tmp_path):
    """Packed utterances on an S3 endpoint, read through both tiers by a DataLoader's
    spawned workers with ``attrs=``: each batch's transcripts and speakers are its
    items', and the batch records were fetched from the endpoint once for the node."""
    options, counter = s3
    rng = np.random.default_rng(8)
    items, attrs = {}, {}
    for i in range(300):
        name = f"spk{i % 4}/utt{i:04d}"
        items[name] = {"wav": rng.integers(-3000, 3000, (1, 4000 + 7 * i)).astype(np.int16)}
        attrs[name] = {"speaker": f"spk{i % 4}", "text": f"utterance {i} — ü"}
    write_h5(tmp_path / "c.h5", items, attrs)
    url = f"s3://zstore-test/attrs-{tmp_path.name}/c.zarr"
    zstore.convert(
        tmp_path / "c.h5", url, rates={"wav": 16000}, storage_options=options, progress=False
    )
    cfg = zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=tmp_path / "ssd", ssd_bytes="256MB"
    )
    ds = zstore.WindowDataset(
        url, window_seconds=0.2, cache=cfg, storage_options=options, attrs=["text", "speaker"]
    )
    loader = torch.utils.data.DataLoader(
        ds, batch_size=32, num_workers=2, multiprocessing_context="spawn", shuffle=True
    )
    before = len(counter.requests)
    seen = 0
    for batch in loader:
        assert batch["text"] == [attrs[n]["text"] for n in batch["item"]]
        assert batch["speaker"] == [attrs[n]["speaker"] for n in batch["item"]]
        seen += len(batch["item"])
    assert seen == 300
    records = [
        p
        for m, p in counter.requests[before:]
        if m == "GET" and "zstore_packed" in p and ".json" in p
    ]
    assert records and len(records) == len(set(records)), records


def test_store_info_names_the_item_attributes(tmp_path):
    """`zstore info` says which attributes items carry, for `attrs=`; a store whose items
    have none says nothing of them."""
    _corpus(tmp_path / "c.h5")
    store = str(tmp_path / "c.zarr")
    zstore.convert(str(tmp_path / "c.h5"), store, rates={"wav": 16000}, workers=1, progress=False)
    info = zstore.store_info(store)
    assert set(info["item_attrs"]) == {"speaker", "text", "gain_db", "snr", "channels", "corpus"}
    assert "item attributes (of 'spk0/utt0'; ds.item_attrs, attrs=): " in info["text"]
    from pathlib import Path

    for record in Path(store).glob("zstore_packed/*/items.*.json"):  # damaged: info still works
        record.write_bytes(b"not json")
    damaged = zstore.store_info(store)
    assert damaged["item_attrs"] == [] and damaged["items"] == info["items"]
    write_h5(tmp_path / "bare.h5", {"u0": {"wav": np.zeros((1, 1600), np.int16)}})
    zstore.convert(
        tmp_path / "bare.h5",
        tmp_path / "bare.zarr",
        rates={"wav": 16000},
        workers=1,
        progress=False,
    )
    bare = zstore.store_info(str(tmp_path / "bare.zarr"))
    assert bare["item_attrs"] == [] and "item attributes" not in bare["text"]
