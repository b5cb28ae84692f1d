"""``zstore tidy``: the item tables appends replaced, and the temporary files of killed
writes, removed from a finished store; nothing a reader of the store needs."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
from conftest import assert_one_line_error, cli, manifest_of, write_h5

import zstore
from zstore.format.layout import MANIFEST_ATTR, PROGRESS_ATTR

RATES = {"wav": 16000, "act": 100}
WEEK = 7 * 86400


def _files(where: Path, n: int) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    """``n`` HDF5 files f0.h5 ... of 2 recordings each (of 1-2 s)."""
    rng = np.random.default_rng(0)
    out = {}
    for k in range(n):
        items = {}
        for i in range(2):
            frames = 100 * (1 + i)
            items[f"u{k}_{i}"] = {
                "wav": (rng.integers(-32768, 32768, (1, frames * 160)) / 32768).astype(np.float32),
                "act": (rng.random((2, frames)) > 0.5).astype(np.float32),
            }
        write_h5(where / f"f{k}.h5", items)
        out[f"f{k}.h5"] = items
    return out


def _appended_store(tmp_path: Path, appends: int = 3, **so) -> tuple[str, dict]:
    data = _files(tmp_path, appends + 1)
    store = so.pop("store", str(tmp_path / "s.zarr"))
    options = {"workers": 1, "progress": False, **so}
    zstore.convert(str(tmp_path / "f0.h5"), store, rates=RATES, pack_seconds=0, **options)
    for k in range(1, appends + 1):
        zstore.append(str(tmp_path / f"f{k}.h5"), store, **options)
    return store, {item: a for items in data.values() for item, a in items.items()}


def _tables(store: Path) -> list[str]:
    return sorted(p.name for p in store.iterdir() if p.name.startswith("zstore_items_"))


def _current(store: Path) -> str:
    return json.loads((store / "zarr.json").read_text())["attributes"][MANIFEST_ATTR]["table"]


def _age(store: Path, table: str, seconds: float) -> None:
    """Make ``table`` look last written ``seconds`` ago."""
    then = time.time() - seconds
    for here, _, names in os.walk(store / table):
        for name in names:
            os.utime(os.path.join(here, name), (then, then))


def _reads_back(store: str, data: dict, **so) -> None:
    ds = zstore.WindowDataset(store, window_seconds=None, cache=False, **so)
    assert len(ds) == len(data)
    for i in range(len(ds)):
        w = ds[i]
        for name in ("wav", "act"):
            assert np.array_equal(w[name].numpy(), data[w["item"]][name]), (w["item"], name)


def _in_order(store: Path) -> list[str]:
    """The store's tables, oldest first (as the appends wrote them)."""
    return sorted(_tables(store), key=lambda t: (store / t / "zarr.json").stat().st_mtime_ns)


def test_tidy_removes_tables_replaced_longer_ago_than_the_age_only(tmp_path):
    store, data = _appended_store(tmp_path)
    root = Path(store)
    tables = _in_order(root)
    current = _current(root)
    assert len(tables) == 4 and tables[-1] == current  # each append left the one before

    report = zstore.tidy(store)  # all replaced just now: a running job may read them
    assert report.tables == [] and sorted(report.kept_young) == sorted(tables[:3])
    assert sorted(_tables(root)) == sorted(tables)

    # converted 30 days ago, appended to 20, 10 and 2 days ago: the second table was
    # replaced 10 days ago, the third only 2 days ago though written 10 days ago (a
    # job opened last week reads it)
    for table, days in zip(tables, (30, 20, 10, 2)):
        _age(root, table, days * 86400)
    dry = zstore.tidy(store, dry_run=True)
    assert sorted(dry.tables) == sorted(tables[:2]) and dry.nbytes > 0
    assert sorted(_tables(root)) == sorted(tables)  # a dry run removes nothing
    report = zstore.tidy(store)
    assert sorted(report.tables) == sorted(tables[:2]) and report.kept_young == [tables[2]]
    assert "removed 2 old item table(s)" in str(report)
    assert sorted(_tables(root)) == sorted(tables[2:])
    _reads_back(store, data)
    assert zstore.tidy(store, older_than="1d").tables == [tables[2]]  # "7d", "12h", seconds
    assert _tables(root) == [current]  # the one the root names stays, however old
    assert zstore.tidy(store, older_than=0).tables == []  # a rerun finds nothing more
    _reads_back(store, data)


def test_a_reader_opened_before_an_append_reads_on_after_a_tidy(tmp_path):
    """The table a job opened is kept while young: its DataLoader workers, started
    after the append and the tidy, map it again."""
    store, data = _appended_store(tmp_path, appends=1)
    before = zstore.WindowDataset(store, window_seconds=None, cache=False)
    seen = {before[i]["item"] for i in range(len(before))}
    write_h5(tmp_path / "late.h5", {"late0": {k: v for k, v in data["u0_0"].items()}})
    zstore.append(str(tmp_path / "late.h5"), store, workers=1, progress=False)
    zstore.tidy(store)
    import pickle

    worker = pickle.loads(pickle.dumps(before))  # as a DataLoader worker gets it
    assert {worker[i]["item"] for i in range(len(worker))} == seen
    assert len(zstore.WindowDataset(store, window_seconds=None, cache=False)) == len(seen) + 1
    zstore.tidy(store, older_than=0)  # a tidy that does not wait for the job: it is told
    with pytest.raises(zstore.StoreReplacedError, match="appended to .* removed .'zstore tidy'"):
        late = pickle.loads(pickle.dumps(before))
        late[0]


def test_tidy_removes_what_killed_writes_left(tmp_path):
    store, data = _appended_store(tmp_path, appends=1)
    root = Path(store)
    left = [
        root / "zarr.json.4242.partial",  # zstore's atomic write of the root
        root / "u0_1" / "zarr.json.4243.partial",  # an item's completion mark
        root / "u0_1" / "wav" / f"zarr.{uuid.uuid4().hex}.partial",  # zarr's own
    ]
    for path in left:
        path.write_bytes(b'{"cut sh')
    mine = root / "u0_1" / "notes.partial"  # not a temporary file's name: kept
    mine.write_text("mine")
    dry = zstore.tidy(store, dry_run=True)
    assert sorted(dry.partials) == sorted(str(p.relative_to(root)) for p in left)
    assert all(p.exists() for p in left)
    report = zstore.tidy(store)
    assert len(report.partials) == 3 and not any(p.exists() for p in left)
    assert mine.read_text() == "mine"
    _reads_back(store, data)


def test_tidy_refuses_an_unfinished_conversion_and_what_is_no_store(tmp_path):
    store, _ = _appended_store(tmp_path, appends=0)
    meta_path = Path(store) / "zarr.json"
    meta = json.loads(meta_path.read_text())
    fingerprint = manifest_of(store).extra["fingerprint"]
    meta["attributes"] = {PROGRESS_ATTR: fingerprint}  # begun, not published
    meta_path.write_text(json.dumps(meta))
    partial = Path(store) / "u0_0" / "zarr.json.77.partial"
    partial.write_text("")
    with pytest.raises(zstore.DestinationError, match="has not finished; run it again"):
        zstore.tidy(store)
    assert partial.exists()  # nothing removed
    missing = tmp_path / "nothing-here.zarr"
    with pytest.raises(zstore.DestinationError, match="no store there"):
        zstore.tidy(missing)
    assert not missing.exists()  # not made by the lock
    other = tmp_path / "plain"
    other.mkdir()
    (other / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    with pytest.raises(zstore.DestinationError, match="not a zstore store"):
        zstore.tidy(other)
    with pytest.raises(zstore.ConfigError, match="older_than '3x'"):
        zstore.tidy(store, older_than="3x")


def test_tidy_on_s3(tmp_path, s3):
    options, _ = s3
    url = f"s3://zstore-test/tidy-{uuid.uuid4().hex[:8]}/s.zarr"
    store, data = _appended_store(tmp_path, appends=2, store=url, storage_options=options)
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **options)

    def tables() -> list[str]:
        listed = fs.ls(root, detail=False, refresh=True)
        return sorted(p.rsplit("/", 1)[-1] for p in listed if "zstore_items_" in p)

    assert len(tables()) == 3
    assert zstore.tidy(url, storage_options=options).kept_young != []
    report = zstore.tidy(url, older_than=0, storage_options=options)
    assert len(report.tables) == 2 and report.partials == []
    assert len(tables()) == 1
    _reads_back(url, data, storage_options=options)


def test_the_tidy_command(tmp_path):
    store, _ = _appended_store(tmp_path, appends=1)
    out = cli("tidy", store, "--older-than", "0", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "would remove 1 old item table(s)" in out.stdout
    assert "zstore_items_" in out.stdout.splitlines()[1]
    out = cli("tidy", store)
    assert out.returncode == 0 and "removed 0 old item table(s)" in out.stdout
    assert "kept 1 table(s) replaced more recently" in out.stdout
    assert_one_line_error(cli("tidy", store, "--older-than", "3x"), "--older-than '3x'")
    assert_one_line_error(cli("tidy", str(tmp_path / "none.zarr")), "no store there")


@pytest.mark.parametrize(
    "text,seconds",
    [("7d", 7 * 86400), ("12h", 43200), ("30m", 1800), ("45s", 45), ("1w", WEEK), (90, 90)],
)
def test_parse_duration(text, seconds):
    from zstore.units import parse_duration

    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["soon", "3x", -1, "", True, float("inf")])
def test_parse_duration_rejects(bad):
    from zstore.units import parse_duration

    with pytest.raises(zstore.ConfigError, match="--older-than"):
        parse_duration(bad, name="--older-than")


def test_a_table_a_killed_publish_cut_short_is_dated_by_its_data(tmp_path, monkeypatch):
    """A publish writes a table's data, then its metadata: killed between the two, it
    leaves a table of no ``zarr.json``, newer than every other.  It is dated by its
    data (it counted as written at time 0, the oldest, took the replacement time of
    the table after it, and went at once), and goes once that is older than the age.  A file system that
    cannot say when objects were written stops tidy before anything is removed (every
    table was taken for old)."""
    store, data = _appended_store(tmp_path, appends=1)
    root = Path(store)
    old, current = _in_order(root)
    _age(root, old, 30 * 86400)
    _age(root, current, 20 * 86400)
    cut = root / "zstore_items_0123456789ab"
    shutil.copytree(root / old / "c", cut / "c")  # its data, no metadata
    _age(root, cut.name, 2 * 86400)
    report = zstore.tidy(store)  # the cut table is 2 days old, replaced by none
    assert report.tables == [old] and report.kept_young == [cut.name]
    assert zstore.tidy(store, older_than="1d").tables == [cut.name]
    _reads_back(store, data)

    fs = fsspec.filesystem("file")

    def unknown(self, path):
        raise NotImplementedError

    monkeypatch.setattr(type(fs), "modified", unknown)
    with pytest.raises(zstore.DestinationError, match="does not say when an object was written"):
        zstore.tidy(store, older_than=0)
    assert _tables(root) == [current]


def _append_and_tidy_before(monkeypatch, tmp_path, name: str) -> tuple[str, dict, list]:
    """An appended store, and ``zstore.format.manifest``'s ``name`` (a read an open
    makes after the root's) patched to land an append and a tidy with no wait
    (``--older-than 0``) just before its first call, removing the table the root read
    named. The store, its items' data, and a list that holds True once it landed."""
    import zstore.format.manifest as manifest_module

    store, data = _appended_store(tmp_path, appends=1)
    write_h5(tmp_path / "late.h5", {"late0": {k: v for k, v in data["u0_0"].items()}})
    real = getattr(manifest_module, name)
    landed: list[bool] = []

    def append_and_tidy_first(*args, **kwargs):
        if not landed:  # once: between this open's root read and this read
            landed.append(True)  # (the append makes the read too)
            zstore.append(str(tmp_path / "late.h5"), store, workers=1, progress=False)
            assert zstore.tidy(store, older_than=0).tables  # the table just named is gone
        return real(*args, **kwargs)

    monkeypatch.setattr(manifest_module, name, append_and_tidy_first)
    return store, data, landed


def test_an_open_between_an_append_and_a_tidy_reads_the_new_table(tmp_path, monkeypatch):
    """A job opening the store reads its root, then the table the root names. An append
    and a tidy with no wait (``--older-than 0``) landing between the two reads removed
    that table: the open now reads the root again and opens the store as it is (a
    pickled reader, which pins its view, is still told, above)."""
    store, data, landed = _append_and_tidy_before(monkeypatch, tmp_path, "load_table")
    ds = zstore.WindowDataset(store, window_seconds=None, cache=False)
    assert landed and len(ds) == len(data) + 1
    got = {ds[i]["item"]: ds[i]["wav"].numpy() for i in range(len(ds))}
    assert np.array_equal(got["late0"], data["u0_0"]["wav"])
    assert np.array_equal(got["u1_1"], data["u1_1"]["wav"])


def test_zstore_info_between_an_append_and_a_tidy_reads_the_new_table(tmp_path, monkeypatch):
    """The same race for what reads the store's history first (``zstore info``): the
    history's table gone is the store changed, not a damaged table."""
    from zstore.cli._info import store_info

    store, data, landed = _append_and_tidy_before(monkeypatch, tmp_path, "with_history")
    info = store_info(store)
    assert landed and info["items"] == len(data) + 1 and info["appended_sources"] == 2
