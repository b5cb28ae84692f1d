"""``zstore cache warm`` after a job whose reads filled the SSD tier by ranges (its
slotted shard objects, ``fetch="slots"``; a value per chunk, ``fetch="range"``): each
object is made whole from them and only the ranges they lack, over a real S3 endpoint,
not downloaded again."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from pathlib import Path

import numpy as np
import pytest
import zarr
from conftest import PYTHON, subprocess_env

import zstore
from zstore.cache import mark_stats
from zstore.format.layout import Span
from zstore.read.reader import WindowReader


def tier_values(directory):
    with sqlite3.connect(directory / "cache.db") as db:
        return dict(db.execute("SELECT key, filename FROM Cache"))


def shard_gets(counter, since, item):
    """GETs of ``item``'s shard objects since request numbers ``since``: (of ranges, of
    whole objects: s3fs asks for ``bytes=0-``)."""
    ranges = [r for path, r in counter.ranges[since[1] :] if f"/{item}/" in path and "/c/" in path]
    gets = sum(
        1 for m, p in counter.requests[since[0] :] if m == "GET" and f"/{item}/" in p and "/c/" in p
    )
    ranged = sum(1 for r in ranges if r != "bytes=0-")
    return ranged, gets - ranged


#: what a job's reads leave in the SSD tier, by ``fetch``: slotted shard objects, or a
#: value per chunk (``#r<start>-<stop>``) and per shard index (``#s<n>``)
PIECES = {
    "slots": lambda key: key.endswith("#F"),
    "range": lambda key: "#r" in key or "#s" in key,
}


@pytest.mark.parametrize("fetch", sorted(PIECES))
def test_warm_makes_shards_whole_from_the_jobs_pieces(s3, s3_store, small_store, tmp_path, fetch):
    """Warm after a job that read by ranges (its slots, or its chunk values): each
    shard object is made whole from what the tier holds and the ranges it lacks; the
    pieces are removed."""
    options, counter = s3
    cache = zstore.CacheConfig(
        ram_dir=None, ram_bytes=0, ssd_dir=tmp_path / "ssd", ssd_bytes="64MB", fetch=fetch
    )
    root = zarr.open_group(small_store, mode="r")
    items = sorted(root.group_keys(), key=lambda i: root[f"{i}/wav"].shape[-1])
    full, part, none = items[:3], items[-1], items[3:5]  # the longest is read in part
    job = WindowReader(s3_store, cache=cache, storage_options=options).open()
    assert job.fetch == fetch

    def read(item, share=1.0):
        n = root[f"{item}/act"].shape[-1]
        return job.read(
            item, {"act": Span(0, int(n * share)), "wav": Span(0, int(n * share) * 160)}
        )

    read(full[0])  # a fresh job's first read writes nothing into the tier
    for item in full:
        read(item)
    read(part, 0.8)
    values = tier_values(tmp_path / "ssd")
    assert values and all(PIECES[fetch](k) for k in values)
    # one chunk damaged on the device: fetched again, not copied
    damaged = next(f for k, f in values.items() if f"/{full[0]}/wav/" in k and "#s" not in k)
    path = tmp_path / "ssd" / damaged
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))

    since = (len(counter.requests), len(counter.ranges))
    done = zstore.warm(s3_store, cache=cache, storage_options=options, progress=False)
    assert done["items"] == len(items)
    assert shard_gets(counter, since, full[1]) == (0, 0)  # every chunk was in the tier
    assert shard_gets(counter, since, full[2]) == (0, 0)
    assert shard_gets(counter, since, full[0]) == (1, 0)  # the damaged chunk, as a range
    ranged, whole = shard_gets(counter, since, part)
    assert ranged >= 1 and whole == 0  # only the chunks its last fifth lacks
    for item in none:
        assert shard_gets(counter, since, item) == (0, 2)  # wav and act, each whole

    # The tier holds each object once, whole; the pieces are gone.
    values = tier_values(tmp_path / "ssd")
    assert len(values) == 2 * len(items) and all(k.endswith("#W") for k in values)
    stored = sum(f.stat().st_size for f in Path(small_store).rglob("*") if "/c/" in str(f))
    # the value files, not bytes_on_disk: that counts the index's WAL, which the pieces'
    # rows, written and removed, grow by up to its checkpoint size (~4 MB)
    held = sum((tmp_path / "ssd" / f).stat().st_size for f in values.values())
    assert held < 1.2 * stored

    # Another job reads every item whole from the tier: the stored values, no chunk GET.
    before = counter.chunk_gets()
    reader = WindowReader(s3_store, cache=cache, storage_options=options).open()
    for item in items:
        got = reader.read(item, {"wav": Span(0, root[f"{item}/wav"].shape[-1])})["wav"]
        np.testing.assert_array_equal(got, root[f"{item}/wav"][...])
    assert counter.chunk_gets() == before


def test_two_warms_at_once_make_each_shard_whole_once(s3, s3_store, small_store, tmp_path):
    """Two ``zstore cache warm`` processes on one node's slotted SSD tier (a warm run on
    each rank by mistake): each shard is made whole once, from its slots, under the
    node's lock for it, and no chunk is fetched."""
    options, counter = s3
    cache = zstore.CacheConfig(
        ram_dir=None, ram_bytes=0, ssd_dir=tmp_path / "ssd", ssd_bytes="64MB", fetch="slots"
    )
    root = zarr.open_group(small_store, mode="r")
    items = sorted(root.group_keys())
    job = WindowReader(s3_store, cache=cache, storage_options=options).open()
    for item in [items[0], *items]:  # the first read writes nothing
        n = root[f"{item}/act"].shape[-1]
        job.read(item, {"act": Span(0, n), "wav": Span(0, n * 160)})
    assert len(tier_values(tmp_path / "ssd")) == 2 * len(items)
    mark_stats(cache)

    code = (
        "import json, sys, zstore;"
        f"c = zstore.CacheConfig(ram_dir=None, ram_bytes=0, ssd_dir={str(tmp_path / 'ssd')!r},"
        " ssd_bytes='64MB', fetch='slots');"
        f"zstore.warm({s3_store!r}, cache=c, progress=False, workers=2,"
        f" storage_options=json.loads({json.dumps(json.dumps(options))}))"
    )
    before = counter.chunk_gets()
    procs = [
        subprocess.Popen([PYTHON, "-c", code], env=subprocess_env(), stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err.decode()
    assert counter.chunk_gets() == before
    values = tier_values(tmp_path / "ssd")
    assert len(values) == 2 * len(items) and all(k.endswith("#W") for k in values)
    assert zstore.cache_stats(cache)["since_mark"]["ssd"]["fills"] == 2 * len(items)
    reader = WindowReader(s3_store, cache=cache, storage_options=options).open()
    for item in items:
        got = reader.read(item, {"act": Span(0, root[f"{item}/act"].shape[-1])})["act"]
        np.testing.assert_array_equal(got, root[f"{item}/act"][...])
    assert counter.chunk_gets() == before
