"""Train a tiny voice-activity model with DDP on random windows read through zstore.

    torchrun --nproc_per_node=4 examples/train_ddp.py /data/speech.zarr --epochs 2 --workers 4

Every rank and DataLoader worker shares the node's cache; set it once for all of
them with environment variables, e.g.

    ZSTORE_RAM_BYTES=400GB ZSTORE_SSD_DIR=/local/ssd/zstore torchrun ...

Backend: nccl when CUDA is available, else gloo (CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import zlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import zstore


class TinyVAD(torch.nn.Module):
    """wav (mics, samples) -> per-frame speaker activity logits (speakers, frames)."""

    def __init__(self, mics: int, speakers: int, hop: int):
        super().__init__()
        self.frontend = torch.nn.Conv1d(mics, 32, kernel_size=hop, stride=hop)
        self.head = torch.nn.Conv1d(32, speakers, kernel_size=1)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.frontend(wav)))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("store", help="zstore store (path or s3:// URL)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument(
        "--sampler",
        choices=["node", "distributed"],
        default="node",
        help="zstore.NodeSampler (each item stays on one node; default) or "
        "torch's DistributedSampler",
    )
    p.add_argument(
        "--local-world-size",
        type=int,
        default=None,
        help="ranks per node (default: torchrun's LOCAL_WORLD_SIZE)",
    )
    p.add_argument(
        "--loader",
        choices=["zstore", "torch"],
        default="zstore",
        help="zstore.WindowLoader (batches read in-process, default) or torch's "
        "DataLoader with --workers worker processes",
    )
    p.add_argument("--window", type=float, default=10.0, help="window seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", help="directory: each rank writes the windows it read (tests)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)

    ds = zstore.WindowDataset(
        args.store, window_seconds=args.window, seed=args.seed, fields=["wav", "act"], short="pad"
    )  # cache: ZSTORE_* env
    sampler: zstore.NodeSampler | DistributedSampler
    if args.sampler == "node":  # its indices carry the epoch: no ds.set_epoch needed
        sampler = zstore.NodeSampler(ds, seed=args.seed, local_world_size=args.local_world_size)
    else:
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader: zstore.WindowLoader | DataLoader
    if args.loader == "zstore":  # no window crosses a process boundary
        loader = zstore.WindowLoader(ds, args.batch_size, sampler=sampler, pin_memory=cuda)
    else:
        loader = DataLoader(
            ds,
            batch_size=args.batch_size,
            sampler=sampler,
            num_workers=args.workers,
            pin_memory=cuda,
        )
    first = ds[0]
    rate = first["wav"].shape[-1] // first["act"].shape[-1]
    vad = TinyVAD(first["wav"].shape[0], first["act"].shape[0], rate).to(device)
    model = DistributedDataParallel(vad, device_ids=[device.index] if cuda else None)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    seen: list[dict] = []

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ds.set_epoch(epoch)  # the window draw, like the sampler's shuffle
        t0, windows, loss_sum = time.perf_counter(), 0, 0.0
        for batch in loader:
            wav, act = batch["wav"].to(device), batch["act"].to(device)
            logits = model(wav)[..., : act.shape[-1]]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, act)
            opt.zero_grad()
            loss.backward()
            opt.step()
            windows += wav.shape[0]
            loss_sum += loss.item() * wav.shape[0]
            if args.record:
                for j, item in enumerate(batch["item"]):
                    seen.append(
                        {
                            "epoch": epoch,
                            "item": item,
                            "start": float(batch["start"][j]),
                            "wav_crc": zlib.crc32(batch["wav"][j].numpy().tobytes()),
                        }
                    )
        totals = torch.tensor(  # on the backend's device: nccl reduces CUDA tensors only
            [windows, loss_sum, time.perf_counter() - t0], dtype=torch.float64, device=device
        )
        dist.all_reduce(totals[:2])
        if rank == 0:
            n, loss_total, seconds = totals.tolist()
            print(
                f"epoch {epoch}: {int(n)} windows on {world} ranks in {seconds:.2f} s "
                f"({n / seconds:.0f} windows/s), loss {loss_total / max(n, 1):.4f}",
                flush=True,
            )
    if args.record:
        os.makedirs(args.record, exist_ok=True)
        with open(os.path.join(args.record, f"rank{rank}.json"), "w") as f:
            json.dump(seen, f)
    dist.barrier()
    if rank == 0:
        stats = zstore.cache_stats()
        print(
            f"cache: RAM hit rate {stats['ram']['hit_rate']:.1%}, origin "
            f"{stats['origin']['requests']} requests",
            flush=True,
        )
    # Tear down in a fixed order while every rank is still alive: DDP holds the process
    # group, so drop it first; then destroy_process_group really ends the group's threads
    # here rather than during interpreter exit, racing peers that already left.
    del model, opt, loader
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
