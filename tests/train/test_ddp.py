"""A real torchrun DDP job (gloo, CPU): 2 ranks x 2 DataLoader workers on one shared cache."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import zlib

import pytest
from conftest import PYTHON, REPO, free_port, run_or_dump, subprocess_env

import zstore


def run_example(store: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    """examples/train_ddp.py under torchrun, 2 processes on this machine's shared cache
    in ``tmp_path``, recording the windows each rank read in ``tmp_path / "record"``."""
    env = subprocess_env()
    env.update(
        ZSTORE_RAM_DIR=str(tmp_path / "ram"),
        ZSTORE_RAM_BYTES="64MB",
        ZSTORE_SSD_DIR=str(tmp_path / "ssd"),
        ZSTORE_SSD_BYTES="64MB",
        OMP_NUM_THREADS="1",
    )
    cmd = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(REPO / "examples" / "train_ddp.py"),
        store,
        "--window",
        "2.0",
        "--record",
        str(tmp_path / "record"),
        *args,
    ]
    # well below pytest's timeout (a run takes ~15 s): a hang fails with every process's stacks
    proc = run_or_dump(cmd, env, timeout=300, stacks=tmp_path / "stacks")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.parametrize("loader", ["zstore", "torch"])
def test_torchrun_two_ranks_share_the_cache(small_store, tmp_path, loader):
    proc = run_example(
        small_store,
        tmp_path,
        "--epochs",
        "2",
        "--workers",
        "2",
        "--batch-size",
        "2",
        "--seed",
        "7",
        "--loader",
        loader,
    )
    assert "epoch 1:" in proc.stdout and "windows/s" in proc.stdout

    ranks = [json.loads((tmp_path / "record" / f"rank{r}.json").read_text()) for r in (0, 1)]
    ds = zstore.WindowDataset(small_store, window_seconds=2.0, seed=7, cache=False)
    for epoch in (0, 1):
        shares = [[s["item"] for s in rank if s["epoch"] == epoch] for rank in ranks]
        assert len(shares[0]) == len(shares[1]) == len(ds) // 2  # each rank got its share
        assert sorted(shares[0] + shares[1]) == sorted(ds._items)  # together: every item
        ds.set_epoch(epoch)
        for rank in ranks:
            for s in (s for s in rank if s["epoch"] == epoch):
                x = ds[ds._items.index(s["item"])]  # same (seed, epoch, i) in one process
                assert s["start"] == x["start"]
                assert s["wav_crc"] == zlib.crc32(x["wav"].numpy().tobytes())

    # The shared cache was filled once: as many origin bytes as one process reading the
    # same windows alone with its own fresh cache (the requests they take depend on when
    # each shard's fill behind the reads ran).
    shared = zstore.cache_stats(
        zstore.CacheConfig(ram_dir=tmp_path / "ram", ssd_dir=tmp_path / "ssd")
    )
    alone = zstore.CacheConfig(
        ram_dir=tmp_path / "ram1", ram_bytes="64MB", ssd_dir=tmp_path / "ssd1", ssd_bytes="64MB"
    )
    single = zstore.WindowDataset(small_store, window_seconds=2.0, seed=7, cache=alone)
    single[0]  # the example reads item 0 on every rank to size its model
    for epoch in (0, 1):
        single.set_epoch(epoch)
        for i in range(len(single)):
            single[i]
    single.set_epoch(0)
    assert single.settle(timeout=120)  # its last fills behind the reads are done too
    assert shared["origin"]["bytes"] == zstore.cache_stats(alone)["origin"]["bytes"]
    # The ranks read from the node's tiers.  Which tier: a process's first read writes nothing
    # into the RAM tier's slots (its first batch is read with no fill beside it), and with
    # 2 DataLoader workers of one batch each per epoch, the workers' reads are mostly first
    # reads, so RAM hits come and go with the timing (0-11 here); the SSD tier keeps each
    # chunk from the first read on (31-35 hits here).
    assert shared["ram"]["hits"] + shared["ssd"]["hits"] > 0


def test_lightning_datamodule_without_lightning_installed(small_store, cache):
    spec = importlib.util.spec_from_file_location(
        "dm", REPO / "examples" / "lightning_datamodule.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dm = module.ZstoreDataModule(
        small_store, small_store, window_seconds=1.0, batch_size=2, num_workers=0, cache=cache
    )
    dm.setup("fit")
    dm.set_epoch(3)
    batch = next(iter(dm.train_dataloader()))
    assert batch["wav"].shape == (2, 2, 16000) and dm.train_set.epoch == 3
    assert len(list(dm.val_dataloader())) == 3


def test_torchrun_two_nodes_keep_their_items(small_store, tmp_path):
    """2 processes as 2 nodes x 1 rank with NodeSampler: each keeps its items every epoch."""
    run_example(
        small_store,
        tmp_path,
        "--epochs",
        "3",
        "--batch-size",
        "1",
        "--seed",
        "3",
        "--sampler",
        "node",
        "--local-world-size",
        "1",
    )
    ranks = [json.loads((tmp_path / "record" / f"rank{r}.json").read_text()) for r in (0, 1)]
    ds = zstore.WindowDataset(small_store, window_seconds=2.0, seed=3, cache=False)
    homes = []
    for rank in ranks:
        per_epoch = [{s["item"] for s in rank if s["epoch"] == e} for e in range(3)]
        assert per_epoch[0] == per_epoch[1] == per_epoch[2]  # the same items every epoch
        homes.append(per_epoch[0])
        assert len({len([s for s in rank if s["epoch"] == e]) for e in range(3)}) == 1
    assert not homes[0] & homes[1] and homes[0] | homes[1] == set(ds._items)
    starts = {(s["item"], s["epoch"]): s["start"] for s in ranks[0]}
    item = next(iter(homes[0]))
    assert (
        len({starts[(item, e)] for e in range(3)}) > 1 or ds._lengths[ds._items.index(item)] <= 200
    )  # windows move between epochs
