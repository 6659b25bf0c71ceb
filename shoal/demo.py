"""The main job: a small CNN learns scikit-learn's handwritten digits (8x8 images) with shoal's
DistributedDataParallel, each worker training on its shard.

    shoal demo                                   # 2 workers, backend "shoal"
    shoal demo --workers 3 --epochs 8 --backend gloo
    shoal run --nproc-per-node 2 -m shoal.demo   # the same worker under the launcher directly
    shoal run --nproc-per-node 2 --max-restarts 3 -m shoal.demo --checkpoint-dir ckpt   # survives a crash
    shoal demo --live --workers 3                # live recovery: survivors go on when a worker dies
    shoal demo --trace trace --metrics metrics.jsonl   # timelines (shoal trace ...) and per-step metrics

With --checkpoint-dir the run resumes from the newest valid checkpoint there: same step, epoch and
place in the epoch, same optimizer state and RNG, so it continues the sample sequence of an
uninterrupted run exactly.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shoal.distributed as dist
from shoal.checkpoint import CheckpointManager, capture_rng, finish_writes_on_sigterm, restore_rng
from shoal.data import DistributedSampler
from shoal.elastic.faults import maybe_kill
from shoal.observe.metrics import Metrics
from shoal.observe.progress import progress
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


def train(epochs: int, backend: str, batch_size: int, lr: float, seed: int = 0,
          checkpoint_dir: Path | None = None, checkpoint_every: int = 20, metrics_path: Path | None = None) -> float:
    """Train under an already launched job (env:// rendezvous); returns the final test accuracy.
    With `metrics_path`, every rank appends a line per step there."""
    torch.set_num_threads(1)  # workers share the machine's cores
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    train_set, test_set = digits()
    net = digits_cnn()
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    step, start_epoch, start_batch = 0, 0, 0
    manager = CheckpointManager(checkpoint_dir, async_save=True) if checkpoint_dir else None
    latest = manager.load_latest() if manager else None
    if latest is not None:  # every rank reads the same file, so DDP's broadcast changes nothing
        net.load_state_dict(latest.state["model"])
        optimizer.load_state_dict(latest.state["optim"])
        restore_rng(latest.state["rng"])
        step, start_epoch, start_batch = latest.step, latest.state["epoch"], latest.state["batch"]
        if rank == 0:
            print(f"resuming from {latest.path.name}: step {step}, epoch {start_epoch + 1}, batch {start_batch}",
                  flush=True)
    model = DistributedDataParallel(net)
    metrics = Metrics(metrics_path) if metrics_path else None
    sampler = DistributedSampler(train_set, seed=seed)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    if rank == 0:
        print(f"training on {len(train_set)} digits ({len(sampler)} per worker) with {world} workers, "
              f"backend {backend!r}; {len(test_set)} held out for testing", flush=True)
    started = time.perf_counter()
    for epoch in range(start_epoch, epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, dtype=torch.float64)  # loss sum, samples
        batches = progress(loader, f"epoch {epoch + 1}/{epochs}", enabled=rank == 0)
        for batch, (images, labels) in enumerate(batches):
            if epoch == start_epoch and batch < start_batch:
                continue  # consumed before the checkpoint we resumed from
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            step += 1
            total += torch.tensor([loss.item() * len(labels), len(labels)], dtype=torch.float64)
            if metrics is not None:
                metrics.step(loss=loss, samples=len(labels), epoch=epoch)
            if manager is not None and step % checkpoint_every == 0:
                manager.save(step, {"model": net.state_dict(), "optim": optimizer.state_dict(), "rng": capture_rng(),
                                    "epoch": epoch, "batch": batch + 1})
            maybe_kill(rank, step)
        dist.all_reduce(total)
        test_accuracy = accuracy(model.module, test_set)
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {total[0] / total[1]:.4f}, test accuracy {test_accuracy:.1%} "
                  f"({time.perf_counter() - started:.1f}s)", flush=True)
    if manager is not None:
        manager.wait()
    if metrics is not None:
        metrics.close()
    if rank == 0:
        checksum = sum(p.detach().double().sum().item() for p in net.parameters())
        print(f"final parameter checksum {checksum!r} after {step} steps", flush=True)
    dist.destroy_process_group()
    return test_accuracy


def train_live(epochs: int, batch_size: int, lr: float, min_workers: int = 1, seed: int = 0,
               metrics_path: Path | None = None) -> float:
    """Train with live recovery under `shoal run --live`: when a worker dies, the others go on from
    the last committed step, and the worker its launcher starts in its place joins them (with fewer
    than `min_workers`, they wait for it). Returns the final test accuracy."""
    from shoal.data import ElasticSampler
    from shoal.elastic import LiveTraining

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(seed)
    train_set, test_set = digits()
    net = digits_cnn()
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    sampler = ElasticSampler(train_set, batch_size, rank=rank, world_size=world, seed=seed)
    live = LiveTraining(net, optimizer, sampler, min_workers=min_workers)
    loader = DataLoader(train_set, batch_sampler=sampler)
    metrics = Metrics(metrics_path) if metrics_path else None
    if live.group.rank == 0 and live.generation.number == 0:
        print(f"training on {len(train_set)} digits with {world} workers and live recovery; "
              f"{len(test_set)} held out for testing", flush=True)
    started, counts = time.perf_counter(), torch.zeros(len(train_set), dtype=torch.int64)
    for epoch in live.epochs(epochs):
        order = torch.tensor(sampler.order())
        for images, labels in live.batches(loader):
            start = sampler.offset
            with live.step():
                loss = nn.functional.cross_entropy(live.model(images), labels)
                loss.backward()
            counts[order[start:sampler.offset]] += 1  # the committed step: every member's share
            if metrics is not None:
                metrics.step(loss=loss, samples=len(labels), generation=live.generation.number, epoch=epoch)
            maybe_kill(rank, live.steps)
        test_accuracy = accuracy(net, test_set)
        if live.group.rank == 0:
            print(f"epoch {epoch + 1}: test accuracy {test_accuracy:.1%}, {live.generation.size} workers "
                  f"(generation {live.generation.number}) ({time.perf_counter() - started:.1f}s)", flush=True)
    # From the ledger of committed steps, which every member keeps alike from when it joined: rank 0 is
    # the longest-standing member (a launched worker, unless all of them were lost).
    if live.group.rank == 0:
        print(f"samples trained: {int(counts.sum())} over {epochs} epochs; missed {int((counts < epochs).sum())}, "
              f"trained more than once per epoch {int((counts > epochs).sum())}", flush=True)
    live.close()
    if metrics is not None:
        metrics.close()
    return test_accuracy


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--backend", default="shoal", choices=["shoal", "gloo"])
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--checkpoint-dir", type=Path, help="save here, and resume from the newest valid checkpoint")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints")
    parser.add_argument("--live", action="store_true", help="live recovery (run under `shoal run --live`)")
    parser.add_argument("--min-workers", type=int, default=1, help="with --live: below this, wait for workers to join")
    parser.add_argument("--metrics", type=Path, help="append a JSON line per step and rank to this file")
    args = parser.parse_args(argv)
    if args.live:
        train_live(args.epochs, args.batch_size, args.lr, args.min_workers, metrics_path=args.metrics)
        return
    finish_writes_on_sigterm()  # stopped after another worker's failure: keep the checkpoint being written
    train(args.epochs, args.backend, args.batch_size, args.lr, checkpoint_dir=args.checkpoint_dir,
          checkpoint_every=args.checkpoint_every, metrics_path=args.metrics)


if __name__ == "__main__":
    main()
