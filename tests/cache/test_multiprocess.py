"""Several processes ('ranks') share one node cache: right data, one origin read per chunk."""

from __future__ import annotations

import numpy as np
import pytest
import workers
import zarr

import zstore
from zstore.testing import spawn_ranks


def run_ranks(url, cache, n, items, epochs=2):
    def args(rank, barrier, queue):
        order = items[rank * len(items) // n :] + items[: rank * len(items) // n]
        return (url, cache, barrier, order, epochs, queue)

    return spawn_ranks(workers.read_windows, n, args)


@pytest.mark.parametrize("ram_format,ram_bytes", [("decoded", "64MB"), ("encoded", "1MB")])
def test_four_processes_share_one_cache(small_store, tmp_path, ram_format, ram_bytes):
    """Decoded, every shard fits: the origin bytes are exactly one process's.  Encoded,
    a RAM tier smaller than the data (it must refuse or evict): each chunk still comes
    from the origin once for the node (the SSD tier holds the store)."""
    root = zarr.open_group(small_store, mode="r")
    shared = zstore.CacheConfig(
        ram_dir=tmp_path / "ram",
        ram_bytes=ram_bytes,
        ram_format=ram_format,
        ssd_dir=tmp_path / "ssd",
        ssd_bytes="64MB",
    )
    reference = zstore.CacheConfig(
        ram_dir=tmp_path / "ref-ram",
        ram_bytes=ram_bytes,
        ram_format=ram_format,
        ssd_dir=tmp_path / "ref-ssd",
        ssd_bytes="64MB",
    )
    items = list(range(6))
    results = run_ranks(small_store, shared, 4, items)
    [(_, ref)] = run_ranks(small_store, reference, 1, items)
    assert len({pid for pid, _ in results}) == 4
    for _, out in results:
        assert out.keys() == ref.keys()
        for key, (item, length, wav, act) in out.items():
            assert (item, length, wav, act) == ref[key]
    # and the reference equals the origin read with zarr directly
    ds = zstore.WindowDataset(small_store, cache=False, window_seconds=2.0, seed=5)
    for (epoch, i), (item, _length, wav, _act) in ref.items():
        ds.set_epoch(epoch)
        w = ds.window(i)
        expected = root[item]["wav"][:, w.start * 160 : (w.start + w.take) * 160]
        got = np.frombuffer(wav, dtype=np.float32).reshape(2, -1)[:, : expected.shape[1]]
        np.testing.assert_array_equal(got, expected)
    if ram_format == "decoded":
        # A read whose shard's node lock is busy (the lock's stripe held for another
        # shard's fill, by a rank or this process's own fill thread) reads around it and
        # leaves the fill to the shard's next read: which shards the ranks filled depends
        # on timing.  One more pass, each read's fills done before the next, fills the
        # rest in both caches, so both hold every shard.
        for config in (shared, reference):
            again = zstore.WindowDataset(small_store, cache=config, window_seconds=2.0, seed=5)
            for epoch in range(2):
                again.set_epoch(epoch)
                for i in items:
                    again[i]
                    assert again.settle(60)
    stats, ref_stats = zstore.cache_stats(shared), zstore.cache_stats(reference)
    # Each chunk and shard index came from the origin once for the whole node: every
    # chunk fetched filled the SSD tier once (a chunk two ranks fetched would fill twice).
    assert stats["ssd"]["fills"] == stats["ssd"]["entries"] > 0
    if ram_format == "decoded":  # all fits: exactly the bytes of one process alone (the
        # requests they take depend on when each shard's fill behind the reads ran)
        assert stats["ram"]["entries"] == ref_stats["ram"]["entries"]
        assert stats["origin"]["bytes"] == ref_stats["origin"]["bytes"]
    else:  # which shards become resident depends on the order windows arrive in
        assert stats["ram"]["evictions"] + stats["ram"]["rejected"] > 0
    assert stats["ram"]["bytes_on_disk"] <= zstore.parse_size(ram_bytes)
    assert stats["ssd"]["bytes_on_disk"] <= 64_000_000
    assert stats["ram"]["hits"] + stats["ssd"]["hits"] > 0


def test_a_forked_child_does_not_keep_its_parents_locks(tmp_path):
    """``flock`` belongs to the open file, which a forked child shares: a DataLoader
    worker forked while its parent held a shard's lock (a fill behind the reads) would
    otherwise hold that lock for its whole life.  The child closes its copies."""
    import os

    from zstore.cache._locks import StripedLocks

    locks = StripedLocks(str(tmp_path / "locks"), "d")
    held = locks.acquire(["shard"])
    assert held
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child stays alive, holding nothing, until the parent is done
        os.write(ready_w, b"r")
        os.read(go_r, 1)
        os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"r"
        locks.release(held)
        again = locks.acquire(["shard"], wait=False)  # free, though the child lives on
    finally:
        os.write(go_w, b"x")
        os.waitpid(pid, 0)
    assert again is not None
    locks.release(again)
