"""Reading what live training reports: tests/scripts/live_train.py's lines (each generation's reports and each
rank's final line), and a ledger of committed steps replayed in one process."""

from __future__ import annotations

import torch
from torch import nn


def states(stdout: str) -> tuple[dict[str, list[tuple[str, str]]], dict[str, str]]:
    """From live_train.py's output: per generation, (rank, "size step digest") as each member reported
    it on entering; and per rank, its final line."""
    lines = [line.split(": ", 1) for line in stdout.splitlines() if ": " in line]
    reports: dict[str, list[tuple[str, str]]] = {}
    for who, text in lines:
        if text.startswith("generation "):
            generation, size, step, state = text.split()[1::2]
            reports.setdefault(generation, []).append((who, f"{size} {step} {state}"))
    return reports, {who: text for who, text in lines if text.startswith("samples ")}


def assert_alike(reports: dict[str, list[tuple[str, str]]], finals: dict[str, str]) -> None:
    """After each change of membership, every member holds the same parameters, optimizer state and
    schedule at the same step, and all finish with the same."""
    for entries in reports.values():
        assert len(entries) == int(entries[0][1].split()[0]), entries  # every member reported
        assert len({state for _, state in entries}) == 1, entries
    assert len({text.split(" generation ")[1] for text in finals.values()}) == 1, finals


def live_data(samples: int) -> torch.utils.data.TensorDataset:
    """Six features, three classes: what the live tests train on."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(samples, 6, generator=generator, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def replay(ledger: list[tuple[int, int, int]], data: torch.utils.data.TensorDataset, model: nn.Module,
           optimizer: torch.optim.Optimizer, seed: int,
           scheduler: torch.optim.lr_scheduler.LRScheduler | None = None) -> list[torch.Tensor]:
    """The committed steps of a ledger ((start, stop, members) per step, in the epoch's order that `seed`
    shuffles) in one process: each member's mean-loss gradient on its slice, averaged, then a step (and the
    scheduler's)."""
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed)).tolist()
    for start, stop, world in ledger:
        share, extra = divmod(stop - start, world)
        total = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(world):
            lo = start + rank * share + min(rank, extra)
            x, y = data[order[lo:lo + share + (rank < extra)]]
            grads = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(model.parameters()))
            total = [t + g for t, g in zip(total, grads, strict=True)]
        for param, summed in zip(model.parameters(), total, strict=True):
            param.grad = summed / world
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return [p.detach() for p in model.parameters()]
