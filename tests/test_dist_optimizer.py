"""DistributedOptimizer and RemoteModule between real workers: a model whose parameters live on
three owners trains exactly as the same model in one process does (float64)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from shoal import autograd as dist_autograd
from shoal import rpc
from shoal.nn import RemoteModule
from shoal.optim import DistributedOptimizer
from tests.ranks import run_rpc_ranks

STEPS = 20


class SeededLinear(nn.Linear):
    """A float64 Linear whose initial weights depend only on `seed`, on any worker."""

    def __init__(self, fan_in: int, fan_out: int, seed: int) -> None:
        super().__init__(fan_in, fan_out, dtype=torch.float64)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=generator, dtype=torch.float64) * 0.5)
            self.bias.copy_(torch.randn(self.bias.shape, generator=generator, dtype=torch.float64) * 0.1)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 6, generator=generator, dtype=torch.float64),
             torch.randn(8, 2, generator=generator, dtype=torch.float64)) for _ in range(STEPS)]


def _optimizer(name: str) -> tuple[type[torch.optim.Optimizer], dict]:
    return {"sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}), "adam": (torch.optim.Adam, {"lr": 0.01})}[name]


def _reference(name: str) -> list[torch.Tensor]:
    layers = [SeededLinear(6, 5, 1), SeededLinear(5, 4, 2), SeededLinear(4, 2, 3)]
    optimizer_class, kwargs = _optimizer(name)
    optimizer = optimizer_class([p for layer in layers for p in layer.parameters()], **kwargs)
    for x, y in batches():
        optimizer.zero_grad()
        out = layers[2](torch.tanh(layers[1](torch.relu(layers[0](x)))))
        nn.functional.mse_loss(out, y).backward()
        optimizer.step()
    return [p.detach() for layer in layers for p in layer.parameters()]


def _train(rank: int, world: int, name: str) -> list[torch.Tensor] | None:
    params = None
    if rank == 0:
        first = SeededLinear(6, 5, 1)  # on the trainer itself
        second = RemoteModule("w1/cpu", SeededLinear, args=(5, 4, 2))
        third = RemoteModule("rank:2/cpu", SeededLinear, kwargs={"fan_in": 4, "fan_out": 2, "seed": 3})
        optimizer_class, kwargs = _optimizer(name)
        remote_params = second.remote_parameters() + third.remote_parameters()
        optimizer = DistributedOptimizer(optimizer_class, [rpc.RRef(p) for p in first.parameters()] + remote_params,
                                         **kwargs)
        for step, (x, y) in enumerate(batches()):
            with dist_autograd.context() as cid:
                hidden = torch.tanh(second(torch.relu(first(x))))
                out = third.forward_async(hidden).wait() if step % 2 else third(hidden)
                dist_autograd.backward(cid, [nn.functional.mse_loss(out, y)])
                optimizer.step(cid)
        params = [p.detach() for p in first.parameters()] + [rref.to_here().detach() for rref in remote_params]
        assert all(p.grad is None for p in first.parameters())
    return params


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_parameters_on_three_owners_train_as_in_one_process(name: str) -> None:
    got = run_rpc_ranks(_train, 3, name, timeout=90)[0]
    expected = _reference(name)
    assert len(got) == len(expected) == 6
    for index, (g, e) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12, msg=lambda m, i=index: f"parameter {i}: {m}")


class Fails(nn.Module):
    def __init__(self) -> None:
        raise ValueError("this module cannot be built")


class NoStep(torch.optim.SGD):
    def step(self, closure=None):
        raise ArithmeticError("this optimizer refuses to step")


def _errors(rank: int, world: int) -> dict:
    out = {}
    if rank == 0:
        with pytest.raises(ValueError, match="cannot be built"):
            RemoteModule("w1/cpu", Fails)
        with pytest.raises(ValueError, match="CPU tensors only"):
            RemoteModule("w1/cuda:0", nn.Linear, args=(2, 2))
        module = RemoteModule("w1", nn.Linear, args=(2, 2))
        with pytest.raises(RuntimeError, match="remote_parameters"):
            module.parameters()
        assert isinstance(module.get_module_rref().to_here(), nn.Linear)
        optimizer = DistributedOptimizer(NoStep, module.remote_parameters(), lr=0.1)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [module(torch.ones(1, 2)).sum()])
            with pytest.raises(ArithmeticError, match="refuses to step") as raised:
                optimizer.step(cid)
            out["remote_traceback"] = str(raised.value.__cause__)
        with pytest.raises(TypeError, match="as RRefs"):
            DistributedOptimizer(torch.optim.SGD, list(nn.Linear(2, 2).parameters()), lr=0.1)
    return out


def test_remote_module_and_optimizer_errors_are_raised_on_the_caller() -> None:
    out = run_rpc_ranks(_errors, 2, timeout=60)[0]
    assert "on worker 'w1'" in out["remote_traceback"], out["remote_traceback"]


class SlowSGD(torch.optim.SGD):
    """Reads each gradient twice, a while apart: another step that put its own gradient into
    `.grad` meanwhile would show."""

    seen_changes: list[bool] = []

    def step(self, closure=None):
        before = [p.grad.clone() for p in self.param_groups[0]["params"]]
        time.sleep(0.05)  # the step's own work, stretched so that a concurrent step would overlap it
        after = [p.grad for p in self.param_groups[0]["params"]]
        SlowSGD.seen_changes.append(any(not torch.equal(b, a) for b, a in zip(before, after, strict=True)))
        return super().step(closure)


def test_steps_of_two_trainers_on_one_owner_do_not_mix_their_gradients() -> None:
    from shoal.optim.distributed import _LocalOptimizer

    param = torch.zeros(3, requires_grad=True)
    first = _LocalOptimizer(SlowSGD, [param], (), {"lr": 1.0})  # each trainer's DistributedOptimizer
    second = _LocalOptimizer(SlowSGD, [param], (), {"lr": 1.0})  # makes its own on the owner
    threads = [threading.Thread(target=local.apply, args=({param: torch.full((3,), float(g))},))
               for local, g in ((first, 1), (second, 2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert SlowSGD.seen_changes == [False, False]
    assert torch.equal(param.detach(), torch.full((3,), -3.0)) and param.grad is None
