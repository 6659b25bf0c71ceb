"""LiveModules between real workers: a driver trains three RemoteModule stages (on w1, w2, w1; w3,
added as a host, holds none) with SGD and momentum; w2, the middle stage's worker, SIGKILLs itself
inside its forward of a step, or inside its optimizer's step. The stage is built again on w3, every
stage and the momentum are put back as the replica (or the checkpoint) has them, and the driver
trains on in the same process to the parameters of a run that lost nothing (float64)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

from shoal import autograd as dist_autograd
from shoal import rpc
from shoal.checkpoint import ModelParallelCheckpoint
from shoal.elastic import LiveModules
from shoal.elastic.live_modules import Recovery
from shoal.nn import RemoteModule
from shoal.optim import DistributedOptimizer
from tests.ranks import run_rpc_ranks

STEPS, WIDTHS = 10, [6, 5, 4, 2]
PLACEMENT = {"first": "w1", "second": "w2", "third": "w1"}
_forwards = [0]  # on w2: the forwards its stage has run


class Stage(nn.Module):
    """Layer `index` of the model (its weights drawn from `index`); on w2, the process dies in its
    forward number `die_at`."""

    def __init__(self, index: int, die_at: int) -> None:
        super().__init__()
        torch.manual_seed(index)
        self.linear = nn.Linear(WIDTHS[index], WIDTHS[index + 1]).double()
        self.die_at = die_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.die_at >= 0 and rpc.get_worker_info().name == "w2":
            if _forwards[0] == self.die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            _forwards[0] += 1
        return torch.tanh(self.linear(x))


class DyingSGD(torch.optim.SGD):
    """SGD whose process, on w2, dies in its step number `die_at` (before it changes anything)."""

    def __init__(self, params: list, die_at: int, **kwargs: float) -> None:
        super().__init__(params, **kwargs)
        self.die_at, self.steps = die_at, 0

    def step(self, closure: None = None) -> None:
        if rpc.get_worker_info().name == "w2" and self.steps == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.steps += 1
        super().step(closure)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(8, WIDTHS[0], generator=generator, dtype=torch.float64),
            torch.randn(8, WIDTHS[-1], generator=generator, dtype=torch.float64))


def _sgd(params: list) -> DistributedOptimizer:
    return DistributedOptimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9)


def _fault_free() -> list[torch.Tensor]:
    """The same training on one worker, nothing lost."""
    stages = [Stage(index, die_at=-1) for index in range(3)]
    params = [param for stage in stages for param in stage.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step)
        for stage in stages:
            x = stage(x)
        optimizer.zero_grad()
        nn.functional.mse_loss(x, y).backward()
        optimizer.step()
    return [param.detach() for param in params]


def _train(live: LiveModules) -> None:
    def train_step(context_id: int, step: int) -> None:
        x, y = _batch(step)
        for module in live.modules.values():
            x = module(x)
        dist_autograd.backward(context_id, [nn.functional.mse_loss(x, y)])

    while live.step < STEPS:
        live.run(train_step)


def _trained(live: LiveModules) -> list[torch.Tensor]:
    return [rref.to_here() for module in live.modules.values() for rref in module.remote_parameters()]


def _driver(rank: int, world: int, die_at: int, directory: str | None, in_step: bool = False) -> tuple | None:
    """w2 dies in its forward of step `die_at`, or with `in_step`, in its optimizer's step of it."""
    if rank != 0:
        return None
    with pytest.raises(ValueError, match="needs replica=True or checkpoints"):
        LiveModules({"first": RemoteModule("w1/cpu", Stage, args=(0, -1))}, _sgd)
    modules = {key: RemoteModule(f"{worker}/cpu", Stage, args=(index, -1 if in_step else die_at))
               for index, (key, worker) in enumerate(PLACEMENT.items())}
    checkpoints = ModelParallelCheckpoint(directory) if directory else None
    optimizer = (lambda params: DistributedOptimizer(DyingSGD, params, die_at, lr=0.1, momentum=0.9)) if in_step \
        else _sgd
    live = LiveModules(modules, optimizer, replica=checkpoints is None, checkpoints=checkpoints, every=4,
                       hosts=["w1", "w2"])
    with pytest.raises(ValueError, match="no worker is named 'w9'"):
        live.add_host("w9")
    live.add_host("w3")  # a spare (or a replacement that joined): the first choice
    _train(live)
    with pytest.raises(ZeroDivisionError):  # an error no loss caused is the caller's
        live.run(lambda context_id, step: 1 / 0)
    return live.recoveries, _trained(live), [module.on for module in modules.values()]


@pytest.mark.parametrize("source", ["replica", "checkpoint"])
def test_a_lost_middle_stage_is_built_again_and_training_goes_on(source: str, tmp_path: Path) -> None:
    """w2 dies in step 6's forward: from the replica, step 6 is run again; from the checkpoint of
    step 4, steps 4 and 5 are too."""
    directory = str(tmp_path) if source == "checkpoint" else None
    recoveries, trained, placed = run_rpc_ranks(_driver, 4, 6, directory, timeout=120, expect={2: "dies"})[0]
    expected = (6, "memory") if source == "replica" else (4, str(tmp_path / "step-0000000004.pt"))
    assert recoveries == [Recovery(["w2"], {"second": "w3"}, *expected)]
    assert placed == ["w1", "w3", "w1"]
    for got, want in zip(trained, _fault_free(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_loss_inside_the_optimizers_step_restores_the_steps_applied_elsewhere() -> None:
    """w2 dies in its optimizer's step of step 3, after w1 has applied its own (the step's answer waits
    for every owner): the replica of step 3 puts w1's stages back too, and the step is run again."""
    recoveries, trained, _ = run_rpc_ranks(_driver, 4, 3, None, True, timeout=120, expect={2: "dies"})[0]
    assert recoveries == [Recovery(["w2"], {"second": "w3"}, 3, "memory")]
    for got, want in zip(trained, _fault_free(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_loss_before_the_first_step_restores_the_first_replica() -> None:
    recoveries, trained, _ = run_rpc_ranks(_driver, 4, 0, None, timeout=120, expect={2: "dies"})[0]
    assert recoveries == [Recovery(["w2"], {"second": "w3"}, 0, "memory")]
    for got, want in zip(trained, _fault_free(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
