"""The main job: a small CNN learns scikit-learn's handwritten digits (8x8 images) with shoal's
DistributedDataParallel, each worker training on its shard.

    shoal demo                                   # 2 workers, backend "shoal"
    shoal demo --workers 3 --epochs 8 --backend gloo
    shoal run --nproc-per-node 2 -m shoal.demo   # the same worker under the launcher directly
    shoal run --nproc-per-node 2 --max-restarts 3 -m shoal.demo --checkpoint-dir ckpt   # survives a crash
    shoal demo --live --workers 3                # live recovery: survivors go on when a worker dies
    shoal demo --trace trace --metrics metrics.jsonl   # timelines (shoal trace ...) and per-step metrics

One training loop (`train`) serves both ways of recovering from a lost worker. By default the launcher
stops the others and starts them all again (`--max-restarts`); with --checkpoint-dir the run resumes
from the newest valid checkpoint there: same step, epoch and place in the epoch, same optimizer state
and RNG, so it continues the sample sequence of an uninterrupted run exactly. With --live the others
go on in the same processes from the last committed step, and the worker the launcher starts in the
lost one's place joins them. To watch it, kill a worker by hand while it trains:

    shoal demo --live --workers 3 --epochs 300 &
    kill -9 $(pgrep -f 'shoal[.]demo' | tail -n 1)

Tests kill a worker at an exact step instead, through `main(on_step=...)` (tests/faults.py).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shoal.distributed as dist
from shoal import config
from shoal.checkpoint import CheckpointManager, capture_rng, finish_writes_on_sigterm, restore_rng
from shoal.data import DistributedSampler, ElasticSampler
from shoal.elastic import LiveTraining
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


def train(epochs: int = 10, *, backend: str = "shoal", batch_size: int = 32, lr: float = 2e-3, seed: int = 0,
          live: bool = False, min_workers: int = 1, checkpoint_dir: Path | None = None, checkpoint_every: int = 20,
          metrics_path: Path | None = None, on_step: Callable[[int, int], None] | None = None) -> float:
    """One worker of a job started by `shoal run` (env:// rendezvous); returns its final test accuracy.

    Without `live`, a lost worker stops the job and `shoal run --max-restarts` starts every worker again;
    with `checkpoint_dir` they resume from the newest valid checkpoint there, saved every
    `checkpoint_every` steps. With `live` (under `shoal run --live`), the others go on from the last
    committed step, and the worker started in the lost one's place joins them (with fewer than
    `min_workers`, they wait for it); live recovery holds its state in memory and trains with backend
    "shoal". With `metrics_path`, every rank appends a line per step there.

    `on_step(rank, step)` is called after each step applied, with this worker's launch rank and the
    number of steps applied so far: a test kills the worker there (tests/faults.py).
    """
    if live and (backend != "shoal" or checkpoint_dir is not None):
        raise ValueError(f"live recovery trains with backend 'shoal' and holds its state in memory: got "
                         f"backend={backend!r} and checkpoint_dir={checkpoint_dir}; leave both out with live=True")
    torch.set_num_threads(1)  # workers share the machine's cores
    if not live:
        dist.init_process_group(backend)  # live recovery forms its own groups, one per generation (below)
    torch.manual_seed(seed)
    train_set, test_set = digits()
    net = digits_cnn()
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    step, start_epoch, start_batch = 0, 0, 0  # where training starts: at the beginning, or a checkpoint's place
    manager = CheckpointManager(checkpoint_dir, async_save=True) if checkpoint_dir else None
    if live:
        # The sampler deals each step's samples out to the members of the generation, whoever they are
        # now, so that every sample is trained once however the membership changes.
        rank, world = config.RANK.get(), config.WORLD_SIZE.get()  # set by the launcher, as torchrun's are
        sampler = ElasticSampler(train_set, batch_size, rank=rank, world_size=world, seed=seed)
        training = LiveTraining(net, optimizer, sampler, min_workers=min_workers)
        model, loader = training.model, DataLoader(train_set, batch_sampler=sampler)
        if training.group.rank == 0 and training.generation.number == 0:  # not a worker that joins later
            print(f"training on {len(train_set)} digits with {world} workers and live recovery; "
                  f"{len(test_set)} held out for testing", flush=True)
    else:
        rank, world = dist.get_rank(), dist.get_world_size()
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
        sampler = DistributedSampler(train_set, seed=seed)
        loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
        if rank == 0:
            print(f"training on {len(train_set)} digits ({len(sampler)} per worker) with {world} workers, "
                  f"backend {backend!r}; {len(test_set)} held out for testing", flush=True)
    metrics = Metrics(metrics_path) if metrics_path else None

    started = time.perf_counter()
    counts = torch.zeros(len(train_set), dtype=torch.int64)  # with live: how many times each sample was trained
    # Under live, a worker that joins later starts in the epoch the others are in.
    for epoch in training.epochs(epochs) if live else range(start_epoch, epochs):
        if live:
            # To the epoch's end across changes of membership, which change its batches: no progress bar.
            order, batches = torch.tensor(sampler.order()), training.batches(loader)
        else:
            sampler.set_epoch(epoch)  # under live, training.epochs does it
            batches = progress(loader, f"epoch {epoch + 1}/{epochs}", enabled=rank == 0)
        losses = torch.zeros(2, dtype=torch.float64)  # without live: this worker's loss sum and samples
        for batch, (images, labels) in enumerate(batches):
            if epoch == start_epoch and batch < start_batch:
                continue  # trained before the checkpoint we resumed from
            if live:
                first = sampler.offset
                with training.step() as live_step:  # applied on every member, or discarded on all (one was lost)
                    loss = nn.functional.cross_entropy(model(images), labels)
                    loss.backward()
                if not live_step.committed:
                    continue  # the next generation takes the step again: nothing below counts it
                counts[order[first:sampler.offset]] += 1  # what the step committed: every member's share
                step = training.steps  # a joiner counts on from the others' steps
            else:
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(images), labels)
                loss.backward()
                optimizer.step()
                losses += torch.tensor([loss.item() * len(labels), len(labels)], dtype=torch.float64)
                step += 1
            if metrics is not None:
                metrics.step(loss=loss, samples=len(labels), generation=training.generation.number if live else None,
                             epoch=epoch)
            if manager is not None and step % checkpoint_every == 0:
                manager.save(step, {"model": net.state_dict(), "optim": optimizer.state_dict(), "rng": capture_rng(),
                                    "epoch": epoch, "batch": batch + 1})
            if on_step is not None:
                on_step(rank, step)
        test_accuracy = accuracy(net, test_set)
        if live:
            # No all-reduce of the loss here: outside a step, a member lost would fail the job.
            if training.group.rank == 0:
                print(f"epoch {epoch + 1}: test accuracy {test_accuracy:.1%}, {training.generation.size} workers "
                      f"(generation {training.generation.number}) ({time.perf_counter() - started:.1f}s)", flush=True)
        else:
            dist.all_reduce(losses)
            if rank == 0:
                print(f"epoch {epoch + 1}: loss {losses[0] / losses[1]:.4f}, test accuracy {test_accuracy:.1%} "
                      f"({time.perf_counter() - started:.1f}s)", flush=True)

    if metrics is not None:
        metrics.close()
    if live:
        # From the ledger of committed steps, which every member keeps alike from when it joined: rank 0 is
        # the longest-standing member (a launched worker, unless all of them were lost).
        if training.group.rank == 0:
            print(f"samples trained: {int(counts.sum())} over {epochs} epochs; missed {int((counts < epochs).sum())}, "
                  f"trained more than once per epoch {int((counts > epochs).sum())}", flush=True)
        training.close()
    else:
        if manager is not None:
            manager.wait()
        if rank == 0:
            checksum = sum(p.detach().double().sum().item() for p in net.parameters())
            print(f"final parameter checksum {checksum!r} after {step} steps", flush=True)
        dist.destroy_process_group()
    return test_accuracy


def main(argv: list[str] | None = None, *, on_step: Callable[[int, int], None] | None = None) -> None:
    """The worker's command line (`python -m shoal.demo --help`); `on_step` is passed to `train`."""
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
    if not args.live:
        finish_writes_on_sigterm()  # stopped after another worker's failure: keep the checkpoint being written
    train(args.epochs, backend=args.backend, batch_size=args.batch_size, lr=args.lr, live=args.live,
          min_workers=args.min_workers, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
          metrics_path=args.metrics, on_step=on_step)


if __name__ == "__main__":
    main()
