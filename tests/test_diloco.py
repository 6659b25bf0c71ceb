"""DiLoCo: replicas on real ranks train as DiLoCo's definition, simulated here in one process, says they must,
step by step (inner steps apart, the outer step on the averaged pseudo-gradients every SYNC_EVERY steps);
a run resumed from its state dict mid-period goes on as the uninterrupted one; bad arguments raise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.ranks import run_ranks

STEPS, SYNC_EVERY = 8, 3  # synchronizations after steps 3 and 6 (1-based)


def _net(rank: int) -> nn.Module:
    """Each rank starts from other values: DiLoCo must start every replica from rank 0's."""
    torch.manual_seed(rank)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(5, 4, generator=gen, dtype=torch.float64),
             torch.randn(5, 2, generator=gen, dtype=torch.float64)) for _ in range(STEPS)]


def _optimizers(net: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    inner = torch.optim.AdamW(net.parameters(), lr=0.05)
    outer = torch.optim.SGD(net.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return inner, outer


def _local_step(net: nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    opt.zero_grad()
    nn.functional.mse_loss(net(batch[0]), batch[1]).backward()
    opt.step()


def _snapshot(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def _train(rank: int, world: int) -> dict[str, list[list[torch.Tensor]]]:
    from shoal.optim import DiLoCoOptimizer

    batches, out = _batches(rank), {}
    net = _net(rank)
    opt = DiLoCoOptimizer(*_optimizers(net), sync_every=SYNC_EVERY)
    out["run"] = []
    for batch in batches:
        _local_step(net, opt, batch)
        out["run"].append(_snapshot(net))

    net = _net(rank)
    opt = DiLoCoOptimizer(*_optimizers(net), sync_every=SYNC_EVERY)
    for batch in batches[:4]:
        _local_step(net, opt, batch)
    saved = {"model": net.state_dict(), "optim": opt.state_dict()}
    net = _net(rank)
    opt = DiLoCoOptimizer(*_optimizers(net), sync_every=SYNC_EVERY)  # takes rank 0's fresh values...
    net.load_state_dict(saved["model"])                               # ...then this rank's saved ones
    opt.load_state_dict(saved["optim"])
    out["resumed"] = []
    for batch in batches[4:]:
        _local_step(net, opt, batch)
        out["resumed"].append(_snapshot(net))
    return out


def _reference(world: int) -> list[list[list[torch.Tensor]]]:
    """DiLoCo in one process: per step, each replica's parameters."""
    replicas = [_net(0) for _ in range(world)]  # all start as rank 0
    inners = [torch.optim.AdamW(r.parameters(), lr=0.05) for r in replicas]
    global_model = _net(0)
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    batches = [_batches(rank) for rank in range(world)]
    steps = []
    for step in range(STEPS):
        for rank, (net, inner) in enumerate(zip(replicas, inners, strict=True)):
            _local_step(net, inner, batches[rank][step])
        if (step + 1) % SYNC_EVERY == 0:
            with torch.no_grad():
                for i, g in enumerate(global_model.parameters()):
                    g.grad = sum(g - list(r.parameters())[i] for r in replicas) / world
            outer.step()
            for net in replicas:
                net.load_state_dict(global_model.state_dict())
        steps.append([_snapshot(net) for net in replicas])
    return steps


@pytest.mark.parametrize("world", [2, 3])
def test_replicas_train_as_diloco_s_definition_says(world: int) -> None:
    out = run_ranks(_train, world, timeout=60)
    want = _reference(world)
    for step in range(STEPS):
        synced = (step + 1) % SYNC_EVERY == 0
        for rank in range(world):
            for got, expected in zip(out[rank]["run"][step], want[step][rank], strict=True):
                torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12,
                                           msg=lambda m, r=rank, s=step: f"rank {r} step {s}: {m}")
            if step >= 4:
                for got, expected in zip(out[rank]["resumed"][step - 4], out[rank]["run"][step], strict=True):
                    assert torch.equal(got, expected), f"resumed rank {rank} step {step}"
        equal = all(torch.equal(a, b) for a, b in zip(out[0]["run"][step], out[1]["run"][step], strict=True))
        assert equal == synced, f"step {step}: replicas equal {equal}"  # apart between synchronizations


def test_bad_arguments_raise_and_a_synchronization_needs_a_group() -> None:
    net = _net(0)
    inner, outer = _optimizers(net)
    from shoal.optim import DiLoCoOptimizer

    with pytest.raises(ValueError, match="sync_every must be at least 1"):
        DiLoCoOptimizer(inner, outer, sync_every=0)
    other = torch.optim.SGD(_net(1).parameters(), lr=0.7)
    with pytest.raises(ValueError, match="the outer optimizer must hold the same parameters"):
        DiLoCoOptimizer(inner, other, sync_every=3)
    unbound = DiLoCoOptimizer(inner, outer, sync_every=1)  # no default group yet: LiveTraining gives one
    with pytest.raises(RuntimeError, match="init_process_group"):
        unbound.step()
