"""Data parallelism by hand, the way the classic PyTorch tutorial teaches it: every rank trains on its
own shard and, after each backward, all-reduces every gradient and divides by the world size.

    shoal run --nproc-per-node 2 examples/hand_allreduce.py
    shoal run --nproc-per-node 2 examples/hand_allreduce.py --backend gloo --epochs 5
    shoal run --nproc-per-node 2 examples/hand_allreduce.py --checkpoint-dir ckpt   # resumes where it left off
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

import shoal.distributed as dist
from shoal.checkpoint import CheckpointManager, capture_rng, restore_rng
from shoal.data import DataPartitioner
from shoal.demo import digits


def average_gradients(model: nn.Module) -> None:
    """The whole of data parallelism: make every gradient the mean over ranks."""
    world = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad /= world


def partition_dataset(batch_size: int) -> torch.utils.data.DataLoader:
    train_set, _ = digits()
    world = dist.get_world_size()
    shard = DataPartitioner(train_set, [1.0 / world] * world, seed=1234).use(dist.get_rank())
    return torch.utils.data.DataLoader(shard, batch_size=batch_size // world, shuffle=True)


def run(epochs: int, batch_size: int, checkpoint_dir: Path | None) -> None:
    torch.manual_seed(1234)  # the same initial model on every rank
    loader = partition_dataset(batch_size)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    manager = CheckpointManager(checkpoint_dir) if checkpoint_dir else None
    latest = manager.load_latest() if manager else None
    start = 0
    if latest is not None:  # the RNG state makes the loader shuffle as an uninterrupted run would
        model.load_state_dict(latest.state["model"])
        optimizer.load_state_dict(latest.state["optim"])
        restore_rng(latest.state["rng"])
        start = latest.step
        print(f"Rank {dist.get_rank()} resuming at epoch {start}", flush=True)
    for epoch in range(start, epochs):
        epoch_loss = 0.0
        for images, labels in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(images), labels)
            epoch_loss += loss.item()
            loss.backward()
            average_gradients(model)
            optimizer.step()
        print(f"Rank {dist.get_rank()}, epoch {epoch}: {epoch_loss / len(loader):.4f}", flush=True)
        if manager is not None:  # rank 0 writes; every rank's RNG is in step, so its state serves all
            manager.save(epoch + 1, {"model": model.state_dict(), "optim": optimizer.state_dict(),
                                     "rng": capture_rng()})
    checksum = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().sum().item()
    print(f"Rank {dist.get_rank()} parameter checksum {checksum:.12e}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="shoal", choices=["shoal", "gloo"])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="global, split over the ranks")
    parser.add_argument("--checkpoint-dir", type=Path, help="save each epoch here and resume from the newest")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    run(args.epochs, args.batch_size, args.checkpoint_dir)
    dist.destroy_process_group()
