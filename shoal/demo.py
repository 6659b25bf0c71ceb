"""The main job: a small CNN learns scikit-learn's handwritten digits (8x8 images) with shoal's
DistributedDataParallel, each worker training on its shard.

    shoal demo                                   # 2 workers, backend "shoal"
    shoal demo --workers 3 --epochs 8 --backend gloo
    shoal run --nproc-per-node 2 -m shoal.demo   # the same worker under the launcher directly
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

import shoal.distributed as dist
from shoal.data import DistributedSampler
from shoal.parallel import DistributedDataParallel


def digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The 1,797 digits shipped with scikit-learn, scaled to [0, 1], split once with a fixed seed."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(len(labels) * (1 - test_fraction))
    train, test = order[:cut], order[cut:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def digits_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    with torch.no_grad():
        images, labels = data.tensors
        correct = (model(images).argmax(dim=1) == labels).sum().item()
    model.train()
    return correct / len(labels)


def train(epochs: int, backend: str, batch_size: int, lr: float, seed: int = 0) -> float:
    """Train under an already launched job (env:// rendezvous); returns the final test accuracy."""
    torch.set_num_threads(1)  # workers share the machine's cores
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    train_set, test_set = digits()
    model = DistributedDataParallel(digits_cnn())
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    sampler = DistributedSampler(train_set, seed=seed)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    if rank == 0:
        print(f"training on {len(train_set)} digits ({len(sampler)} per worker) with {world} workers, "
              f"backend {backend!r}; {len(test_set)} held out for testing", flush=True)
    started = time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, dtype=torch.float64)  # loss sum, samples
        for images, labels in tqdm(loader, desc=f"epoch {epoch + 1}/{epochs}", disable=rank != 0, leave=False,
                                   file=sys.stdout, mininterval=0.5):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(labels), len(labels)], dtype=torch.float64)
        dist.all_reduce(total)
        test_accuracy = accuracy(model.module, test_set)
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {total[0] / total[1]:.4f}, test accuracy {test_accuracy:.1%} "
                  f"({time.perf_counter() - started:.1f}s)", flush=True)
    dist.destroy_process_group()
    return test_accuracy


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--backend", default="shoal", choices=["shoal", "gloo"])
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args(argv)
    train(args.epochs, args.backend, args.batch_size, args.lr)


if __name__ == "__main__":
    main()
