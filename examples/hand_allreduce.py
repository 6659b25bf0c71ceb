"""Data parallelism by hand, the way the classic PyTorch tutorial teaches it: every rank trains on its
own shard and, after each backward, all-reduces every gradient and divides by the world size.

    shoal run --nproc-per-node 2 examples/hand_allreduce.py
    shoal run --nproc-per-node 2 examples/hand_allreduce.py --backend gloo --epochs 5
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import shoal.distributed as dist
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


def run(epochs: int, batch_size: int) -> None:
    torch.manual_seed(1234)  # the same initial model on every rank
    loader = partition_dataset(batch_size)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    for epoch in range(epochs):
        epoch_loss = 0.0
        for images, labels in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(images), labels)
            epoch_loss += loss.item()
            loss.backward()
            average_gradients(model)
            optimizer.step()
        print(f"Rank {dist.get_rank()}, epoch {epoch}: {epoch_loss / len(loader):.4f}", flush=True)
    checksum = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().sum().item()
    print(f"Rank {dist.get_rank()} parameter checksum {checksum:.12e}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="shoal", choices=["shoal", "gloo"])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="global, split over the ranks")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    run(args.epochs, args.batch_size)
    dist.destroy_process_group()
