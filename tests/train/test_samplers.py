"""Samplers: the epoch travels with the index; NodeSampler keeps items on their node,
balanced, covering every index each epoch, resumable and deterministic."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import zstore
from zstore.train.samplers import assign_nodes


def test_epoch_travels_with_the_index(small_store):
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=False, seed=4)
    for epoch in (0, 3):
        ds.set_epoch(epoch)
        plain = ds[2]
        ds.set_epoch(99)
        paired = ds[(epoch, 2)]
        assert plain["start"] == paired["start"] and torch.equal(plain["wav"], paired["wav"])


def test_windows_per_item(small_store):
    one = zstore.WindowDataset(small_store, window_seconds=1.0, cache=False, seed=1)
    three = zstore.WindowDataset(
        small_store, window_seconds=1.0, cache=False, seed=1, windows_per_item=3
    )
    assert len(three) == 3 * len(one)
    assert three[(0, 0)]["start"] == one[(0, 0)]["start"]  # window 0 as before
    starts = {three[(0, i)]["start"] for i in range(3)}
    assert {three[(0, i)]["item"] for i in range(3)} == {one[0]["item"]}
    assert len(starts) > 1
    with pytest.raises(zstore.ConfigError):
        zstore.WindowDataset(small_store, cache=False, windows_per_item=0)


def test_window_sampler_with_persistent_workers_changes_windows(small_store, cache):
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=cache, seed=2)
    sampler = zstore.WindowSampler(ds, shuffle=True, seed=5)
    loader = DataLoader(
        ds,
        batch_size=2,
        sampler=sampler,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="spawn",
    )
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)  # all a training loop (or Lightning) does
        epochs.append({(i, float(s)) for b in loader for i, s in zip(b["item"], b["start"])})
    assert all(len(e) == len(ds) for e in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]


def layout(ds, world, local, **kw):
    return [
        zstore.NodeSampler(ds, num_replicas=world, rank=r, local_world_size=local, **kw)
        for r in range(world)
    ]


@pytest.fixture
def ds(small_store):
    return zstore.WindowDataset(small_store, window_seconds=1.0, cache=False, windows_per_item=4)


def test_node_sampler_covers_keeps_and_balances(ds):
    samplers = layout(ds, 4, 2, seed=3)  # 2 nodes x 2 ranks
    assert len({len(s) for s in samplers}) == 1
    homes = None
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        orders = [list(s) for s in samplers]
        assert all(e == epoch for o in orders for e, _ in o)
        seen = {i for o in orders for _, i in o}
        assert seen == set(range(len(ds)))  # every index, every epoch
        node_sets = [{i for o in orders[n * 2 : (n + 1) * 2] for _, i in o} for n in range(2)]
        assert not node_sets[0] & node_sets[1]
        homes = homes or node_sets
        assert node_sets == homes  # the same items on the same node every epoch
    lengths = np.asarray(ds.item_lengths())
    home = samplers[0].item_home
    totals = [lengths[home == n].sum() for n in range(2)]
    assert abs(totals[0] - totals[1]) <= lengths.max()
    k = ds.windows_per_item  # every window of an item is on the item's node
    for n in range(2):
        assert all(home[i // k] == n for i in node_sets[n])


def test_node_sampler_is_deterministic_and_shuffles_per_epoch(ds):
    a, b = layout(ds, 2, 1, seed=9)[0], layout(ds, 2, 1, seed=9)[0]
    assert a.order(0) == b.order(0) and a.order(0) != a.order(1)
    assert sorted(a.order(0)) == sorted(a.order(1))


def test_more_nodes_move_little():
    rng = np.random.default_rng(0)
    lengths = rng.integers(300, 3000, 4000)
    for p in (2, 3, 4, 7):
        before, after = assign_nodes(lengths, p, 1), assign_nodes(lengths, p + 1, 1)
        moved = (before != after).mean()
        assert moved <= 1 / (p + 1) + 0.02, (p, moved)
        totals = [lengths[after == q].sum() for q in range(p + 1)]
        assert max(totals) - min(totals) <= lengths.max()


def test_resume_mid_epoch(ds):
    s = layout(ds, 2, 1, seed=1)[1]
    s.set_epoch(2)
    full = list(s)
    state = s.state_dict(consumed=5)
    fresh = layout(ds, 2, 1, seed=1)[1]
    fresh.load_state_dict(state)
    assert list(fresh) == full[5:]
    other = layout(ds, 4, 2, seed=1)[1]
    with pytest.raises(zstore.ConfigError, match="layout"):
        other.load_state_dict(state)


def test_layout_from_the_environment_and_errors(ds, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    s = zstore.NodeSampler(ds)
    assert (s.nodes, s.node, s.local_rank) == (2, 1, 1)
    assert zstore.NodeSampler(ds, local_world_size=1).nodes == 4  # arguments win
    with pytest.raises(zstore.ConfigError, match="same number of ranks"):
        zstore.NodeSampler(ds, num_replicas=5, rank=0, local_world_size=2)
    with pytest.raises(zstore.ConfigError, match="not a layout"):
        zstore.NodeSampler(ds, num_replicas=2, rank=2, local_world_size=1)
    with pytest.raises(zstore.ConfigError, match="no index"):
        zstore.NodeSampler(ds, num_replicas=64, rank=0, local_world_size=1, drop_last=True)


def test_a_node_share_larger_than_its_tiers_warns(small_store, tmp_path):
    cfg = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="1MB", ssd_dir=None)
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=cfg)
    with pytest.warns(UserWarning, match="node 0's share .* exceeds its RAM \\+ SSD"):
        zstore.NodeSampler(ds, num_replicas=2, rank=0, local_world_size=1)
    roomy = zstore.CacheConfig(ram_dir=tmp_path / "ram2", ram_bytes="64MB", ssd_dir=None)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zstore.NodeSampler(
            zstore.WindowDataset(small_store, window_seconds=1.0, cache=roomy),
            num_replicas=2,
            rank=0,
            local_world_size=1,
        )


def test_rotate_moves_a_fraction_each_epoch(ds):
    s = layout(ds, 2, 1, seed=1, rotate=0.25)[0]
    moved = (s.nodes_of(1) != s.home).mean()
    assert 0.05 < moved < 0.5
    assert (s.nodes_of(1) != s.nodes_of(2)).any()


def test_node_sampler_under_window_loader(small_store, cache):
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=cache, windows_per_item=4)
    s = layout(ds, 2, 1, seed=2)[0]
    loader = zstore.WindowLoader(ds, 4, sampler=s)
    loader.set_epoch(1)
    got = [i for b in loader for i in b["item"]]
    assert len(got) == len(s)


def test_warm_one_nodes_share(small_store, tmp_path):
    from conftest import zstore_cli

    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=False)
    home = zstore.NodeSampler(ds, num_replicas=2, rank=0, local_world_size=1, seed=4).item_home
    dirs = ["--ram-dir", str(tmp_path / "ram"), "--ram-bytes", "64MB", "--ssd-dir", "none"]
    proc = zstore_cli(
        "cache",
        "warm",
        small_store,
        "--nodes",
        "2",
        "--node-rank",
        "1",
        "--seed",
        "4",
        "--no-progress",
        *dirs,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"warmed {int((home == 1).sum())} items" in proc.stdout
    cfg = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=None)
    warmed = zstore.WindowDataset(small_store, window_seconds=1.0, cache=cfg)
    before = zstore.cache_stats(cfg)["origin"]["requests"]
    for i in range(len(warmed)):
        if home[i] == 1:
            warmed[i]
    assert zstore.cache_stats(cfg)["origin"]["requests"] == before  # all from RAM
    share = zstore_cli(
        "cache",
        "stats",
        "--store",
        small_store,
        "--nodes",
        "2",
        "--node-rank",
        "1",
        "--seed",
        "4",
        *dirs,
    )
    assert share.returncode == 0, share.stderr
    assert "node 1 of 2:" in share.stdout and "(100%)" in share.stdout
    other = zstore_cli(
        "cache",
        "stats",
        "--store",
        small_store,
        "--nodes",
        "2",
        "--node-rank",
        "0",
        "--seed",
        "4",
        *dirs,
    )
    assert "(0%)" in other.stdout  # node 0's share was not warmed here
    bad = zstore_cli("cache", "warm", small_store, "--nodes", "2", "--node-rank", "2", *dirs)
    assert bad.returncode == 2 and "node rank" in bad.stderr


def test_a_changed_node_count_says_how_much_moved(small_store, tmp_path):
    cfg = zstore.CacheConfig(ram_dir=tmp_path / "ram", ram_bytes="64MB", ssd_dir=None)
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=cfg)
    zstore.NodeSampler(ds, num_replicas=2, rank=0, local_world_size=1, seed=1)
    with pytest.warns(UserWarning, match=r"2 -> 3 nodes moved \d+% of the items"):
        zstore.NodeSampler(ds, num_replicas=3, rank=0, local_world_size=1, seed=1)
    import warnings

    with warnings.catch_warnings():  # the same layout again: nothing to say
        warnings.simplefilter("error")
        zstore.NodeSampler(ds, num_replicas=3, rank=0, local_world_size=1, seed=1)
