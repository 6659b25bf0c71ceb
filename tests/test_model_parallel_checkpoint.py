"""ModelParallelCheckpoint between real workers: a model on four workers (one module local to the
trainer, three RemoteModules) saved mid-training with Adam's state, restored by a job of three
workers that places the modules differently, trains on to the parameters of the run that was never
interrupted (float64, to 1e-12)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shoal import autograd as dist_autograd
from shoal import rpc
from shoal.checkpoint import ModelParallelCheckpoint
from shoal.nn import RemoteModule
from shoal.optim import DistributedOptimizer
from tests.ranks import run_rpc_ranks
from tests.test_dist_optimizer import SeededLinear

STEPS, SAVED_AT = 6, 3
WIDTHS = [6, 5, 4, 3, 2]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(8, WIDTHS[0], generator=generator, dtype=torch.float64),
             torch.randn(8, WIDTHS[-1], generator=generator, dtype=torch.float64)) for _ in range(STEPS)]


def _model(placement: list[str], seed: int) -> dict[str, rpc.RRef | RemoteModule]:
    """Four layers: the first on this worker, the others where `placement` says."""
    modules: dict[str, rpc.RRef | RemoteModule] = {"input": rpc.RRef(SeededLinear(WIDTHS[0], WIDTHS[1], seed))}
    for index, worker in enumerate(placement, start=1):
        modules[f"layer{index}"] = RemoteModule(f"{worker}/cpu", SeededLinear,
                                                args=(WIDTHS[index], WIDTHS[index + 1], seed + index))
    return modules


def _forward(modules: dict[str, rpc.RRef | RemoteModule], x: torch.Tensor) -> torch.Tensor:
    hidden = torch.relu(modules["input"].local_value()(x))
    hidden = torch.tanh(modules["layer1"](hidden))
    return modules["layer3"](torch.relu(modules["layer2"](hidden)))


def _optimizer(modules: dict[str, rpc.RRef | RemoteModule]) -> DistributedOptimizer:
    params = [rpc.RRef(p) for p in modules["input"].local_value().parameters()]
    for key in ("layer1", "layer2", "layer3"):
        params += modules[key].remote_parameters()
    return DistributedOptimizer(torch.optim.Adam, params, lr=0.01)


def _train(modules: dict, optimizer: DistributedOptimizer, steps: range) -> None:
    batches = _batches()
    for step in steps:
        x, y = batches[step]
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [nn.functional.mse_loss(_forward(modules, x), y)])
            optimizer.step(cid)


def _parameters(modules: dict) -> list[torch.Tensor]:
    params = [p.detach().clone() for p in modules["input"].local_value().parameters()]
    for key in ("layer1", "layer2", "layer3"):
        params += [rref.to_here().detach() for rref in modules[key].remote_parameters()]
    return params


def _uninterrupted(rank: int, world: int, directory: str) -> list[torch.Tensor] | None:
    if rank != 0:
        return None
    modules = _model(["w1", "w2", "w3"], seed=1)
    optimizer = _optimizer(modules)
    checkpoints = ModelParallelCheckpoint(directory, keep=2, async_save=True)
    _train(modules, optimizer, range(SAVED_AT))
    without_input = {key: module for key, module in modules.items() if key != "input"}
    with pytest.raises(ValueError, match="belongs to none of the modules"):
        checkpoints.save(SAVED_AT, without_input, optimizer)
    checkpoints.save(SAVED_AT, modules, optimizer, extra={"next_step": SAVED_AT})
    _train(modules, optimizer, range(SAVED_AT, STEPS))  # while the checkpoint is written
    checkpoints.wait()
    return _parameters(modules)


def _resumed(rank: int, world: int, directory: str) -> list[torch.Tensor] | None:
    if rank != 0:
        return None
    modules = _model(["w2", "w1", "w1"], seed=11)  # other initial weights, two modules on one worker
    optimizer = _optimizer(modules)
    checkpoints = ModelParallelCheckpoint(directory)
    with pytest.raises(ValueError, match="layer3"):
        checkpoints.load_latest({key: module for key, module in modules.items() if key != "layer3"}, optimizer)
    latest = checkpoints.load_latest(modules, optimizer)
    assert latest is not None and latest.step == SAVED_AT and latest.state["next_step"] == SAVED_AT
    _train(modules, optimizer, range(latest.state["next_step"], STEPS))
    return _parameters(modules)


def test_saved_on_four_workers_resumes_on_three_with_other_placement(tmp_path: Path) -> None:
    expected = run_rpc_ranks(_uninterrupted, 4, str(tmp_path), names=["t", "w1", "w2", "w3"], timeout=90)[0]
    got = run_rpc_ranks(_resumed, 3, str(tmp_path), names=["t", "w1", "w2"], timeout=90)[0]
    assert len(got) == len(expected) == 8
    for resumed, uninterrupted in zip(got, expected, strict=True):
        torch.testing.assert_close(resumed, uninterrupted, rtol=0, atol=1e-12)


def test_an_empty_directory_restores_nothing(tmp_path: Path) -> None:
    assert ModelParallelCheckpoint(tmp_path).load_latest({}) is None
