"""Hogwild: several processes train one model in shared memory, lock-free, each on its own shuffle of
the digits data (PyTorch's mnist_hogwild example, with only its imports and data set changed).

    python examples/hogwild.py                      # 2 processes
    python examples/hogwild.py --num-processes 1    # the single-process baseline

The model's parameters are put in shared memory once (`model.share_memory()`); every process then
reads and updates them in place without locks, so each sees the others' progress at once.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import shoal.multiprocessing as mp
from shoal.demo import accuracy, digits, digits_cnn


def train(rank: int, args: argparse.Namespace, model: nn.Module) -> None:
    torch.manual_seed(args.seed + rank)  # each process its own shuffle
    torch.set_num_threads(1)  # the processes share the cores
    train_set, _ = digits()
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    for epoch in range(1, args.epochs + 1):
        model.train()
        for images, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()  # writes straight into the shared parameters
        print(f"process {rank} epoch {epoch}: loss {loss.item():.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = digits_cnn()
    model.share_memory()  # gradients are allocated later, in each process, so they stay private
    processes = []
    for rank in range(args.num_processes):
        process = mp.Process(target=train, args=(rank, args, model))
        process.start()
        processes.append(process)
    for process in processes:
        process.join()
    failed = [rank for rank, process in enumerate(processes) if process.exitcode != 0]
    if failed:
        raise SystemExit(f"training process(es) {failed} failed")
    _, test_set = digits()
    print(f"test accuracy {100 * accuracy(model, test_set):.2f}%")


if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    main()
