"""LiveTraining with optimizers that synchronize the replicas every few steps (DiLoCo, post-local SGD): with
no loss, the same parameters as the replicas simulated in one process; a lost worker's period undone and
trained again (tests/test_live.py runs that under the launcher); and the settings it refuses."""

from __future__ import annotations

import copy
import os
from datetime import timedelta

import pytest
import torch
from torch import nn

from shoal.comm.store import Store
from shoal.data import ElasticSampler
from shoal.elastic.live import LiveTraining
from shoal.optim import DiLoCoOptimizer, PostLocalSGDOptimizer
from shoal.parallel import PeriodicModelAverager
from tests.live_reports import live_data
from tests.ranks import run_ranks

SAMPLES, BATCH, SEED, WORLD = 61, 2, 1, 3
PERIOD = 4  # 10 steps an epoch at 3 ranks: periods of 4, 4 and 2 (the epoch's end ends one)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(6, 3).double()


def _optimizers(model: nn.Module, kind: str) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """The inner (local) optimizer, and what LiveTraining is given."""
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if kind == "diloco":
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        return inner, DiLoCoOptimizer(inner, outer, sync_every=PERIOD)
    return inner, PostLocalSGDOptimizer(inner, PeriodicModelAverager(period=PERIOD))


def _train(rank: int, world: int, _: int, store_port: int, kind: str, epochs: int) -> tuple:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port),
                      TORCHELASTIC_USE_AGENT_STORE="True", SHOAL_LIVE="1")  # as `shoal run --live` sets them
    data, model = live_data(SAMPLES), _model()
    _, optimizer = _optimizers(model, kind)
    sampler = ElasticSampler(data, BATCH, rank=rank, world_size=world, seed=SEED)
    live = LiveTraining(model, optimizer, sampler, timeout=timedelta(seconds=30))
    assert live.model is model
    final = []  # the steps that ended a period
    for _ in live.epochs(epochs):
        for x, y in live.batches(torch.utils.data.DataLoader(data, batch_sampler=sampler)):
            with live.step() as step:
                nn.functional.cross_entropy(live.model(x), y).backward()
            assert step.committed
            if step.synchronized:
                final.append(live.steps)
    live.close()
    counted = optimizer.local_steps if kind == "diloco" else optimizer.averager.step
    assert counted == live.steps, f"the optimizer counted {counted} steps of {live.steps}"
    return final, [p.detach().clone() for p in model.parameters()]


def _simulated(kind: str, epochs: int) -> tuple[list[int], list[torch.Tensor]]:
    """The replicas in one process: each its own model and inner optimizer, fed what its rank's sampler
    hands out; at each period's end, DiLoCo's outer step or the average of the parameters."""
    data, model = live_data(SAMPLES), _model()
    _, synchronizing = _optimizers(model, kind)
    replicas = [copy.deepcopy(model) for _ in range(WORLD)]
    inners = [torch.optim.SGD(replica.parameters(), lr=0.1, momentum=0.9) for replica in replicas]
    samplers = [ElasticSampler(data, BATCH, rank=rank, world_size=WORLD, seed=SEED) for rank in range(WORLD)]
    final, steps, taken = [], 0, 0
    for epoch in range(epochs):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        for batches in zip(*samplers, strict=True):
            for replica, inner, indices in zip(replicas, inners, batches, strict=True):
                x, y = data[indices]
                inner.zero_grad()
                nn.functional.cross_entropy(replica(x), y).backward()
                inner.step()
            steps, taken = steps + 1, taken + 1
            if taken < PERIOD and not samplers[0].handed_out_all:
                continue
            with torch.no_grad():
                mean = [torch.stack(ps).mean(0) for ps in zip(*(r.parameters() for r in replicas), strict=True)]
                for param, averaged in zip(model.parameters(), mean, strict=True):
                    if kind == "diloco":
                        param.grad = param - averaged  # the pseudo-gradient, averaged
                    else:
                        param.copy_(averaged)
                if kind == "diloco":
                    synchronizing.outer.step()
                for replica in replicas:
                    replica.load_state_dict(model.state_dict())
            final.append(steps)
            taken = 0
    return final, [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["diloco", "post-local SGD"])
def test_with_no_loss_the_replicas_synchronize_as_simulated_in_one_process(kind: str) -> None:
    store = Store.connect("127.0.0.1", 0, world_size=1, is_server=True)  # the launcher's
    out = run_ranks(_train, WORLD, store.raw.port, kind, 2, backend=None, timeout=90)
    want_final, want = _simulated(kind, 2)
    assert want_final == [4, 8, 10, 14, 18, 20]
    for final, params in out.values():
        assert final == want_final
        for got, expected in zip(params, want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def test_live_training_refuses_what_a_periodic_optimizer_cannot_take(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_LIVE", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    model = _model()
    sampler = ElasticSampler(live_data(SAMPLES), BATCH, rank=0, world_size=1)
    warming = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), PeriodicModelAverager(2, 10))
    with pytest.raises(ValueError, match="warm-up is DDP's: train the warm-up steps in a LiveTraining of their own"):
        LiveTraining(model, warming, sampler)
    _, diloco = _optimizers(model, "diloco")
    with pytest.raises(ValueError, match="the model is neither wrapped in DDP nor fully_shard"):
        LiveTraining(model, diloco, sampler, bucket_cap_mb=1)
