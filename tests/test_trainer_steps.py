"""TrainerSteps between real workers: a parameter server and three trainers, two of which are
SIGKILLed mid-step: one between its backward and its step, one after the server has its step but
before the step is applied (the last trainer waits for it to die). The job finishes in the same
processes, every sample of every epoch is applied exactly once, and the server's parameters equal
a replay, in one process, of the steps it applied (float64). Then the server is SIGKILLed, and made
again on a trainer: from its last checkpoint (the steps since are redone), or from its replica,
which loses no step that a trainer heard was applied."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

from shoal import autograd as dist_autograd
from shoal import rpc
from shoal.checkpoint import ModelParallelCheckpoint
from shoal.elastic import TrainerSteps
from shoal.optim import DistributedOptimizer
from tests.ranks import run_ranks, run_rpc_ranks
from tests.waiting import wait_until

TRAINERS = ["t1", "t2", "t3"]
SAMPLES, BATCH, EPOCHS, LR = 96, 8, 3, 0.05
HOLDING_DIES, ARRIVED_DIES = ("t3", 2), ("t2", 5)  # (trainer, its n-th batch): where each dies


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return (torch.randn(SAMPLES, 6, generator=generator, dtype=torch.float64),
            torch.randn(SAMPLES, 2, generator=generator, dtype=torch.float64))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)).double()


def _optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


_server: dict = {}
_made = threading.Lock()


def _handles() -> tuple[rpc.RRef, rpc.RRef, list[rpc.RRef]]:
    """Runs on the server: the model, the steps and the parameters, made by the first to ask."""
    with _made:
        if not _server:
            model = _model()
            _server.update(model=model, steps=TrainerSteps(TRAINERS, samples=SAMPLES, batch_size=BATCH, epochs=EPOCHS,
                                                           seed=5),
                           initial=[p.detach().clone() for p in model.parameters()])
        model = _server["model"]
        return rpc.RRef(model), rpc.RRef(_server["steps"]), [rpc.RRef(p) for p in model.parameters()]


def _where(trainer: str) -> tuple[str, int]:
    """Runs on the server: what `trainer` is doing (white-box), and how many of its steps applied."""
    steps = _server["steps"]
    with steps._lock:
        state = ("lost" if trainer not in steps._living else "arrived" if trainer in steps._arrived else
                 "holding" if trainer in steps._holding else "other")
        return state, sum(1 for batch in steps.applied if batch.trainer == trainer)


def _train(rank: int, world: int) -> tuple | None:
    if rank == 0:
        with pytest.raises(ValueError, match="no worker is named 't4'"):  # it would be waited for forever
            TrainerSteps([*TRAINERS, "t4"], samples=SAMPLES, batch_size=BATCH, epochs=EPOCHS)
        model, steps, _ = _handles()
        steps.local_value().wait(timeout=90)
        assert [worker.name for worker in rpc.lost_workers()] == ["t2", "t3"]
        applied = [(b.step, b.epoch, b.trainer, b.indices.tolist()) for b in steps.local_value().applied]
        return _server["initial"], [p.detach().clone() for p in model.local_value().parameters()], applied
    name = TRAINERS[rank - 1]
    model, steps, params = rpc.rpc_sync("ps", _handles)
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=LR, momentum=0.9)
    images, targets = _data()
    for count in itertools.count(1):
        batch = steps.rpc_sync().next_batch(name)
        if batch is None:
            return None
        with dist_autograd.context() as context_id:
            loss = nn.functional.mse_loss(model.rpc_sync().forward(images[batch.indices]), targets[batch.indices])
            dist_autograd.backward(context_id, [loss])
            if (name, count) == HOLDING_DIES:
                os.kill(os.getpid(), signal.SIGKILL)
            if name == "t1":  # t2 dies having asked for the step of its last batch: t1 asks for its own after
                victim, last = ARRIVED_DIES
                while (where := rpc.rpc_sync("ps", _where, args=(victim,)))[1] == last - 1 and where[0] != "lost":
                    time.sleep(0.005)
            stepped = steps.rpc_async().step(batch, optimizer, context_id)
            if (name, count) == ARRIVED_DIES:
                while rpc.rpc_sync("ps", _where, args=(name,))[0] != "arrived":
                    time.sleep(0.005)
                os.kill(os.getpid(), signal.SIGKILL)
            stepped.wait()
    return None


def _replay(applied: list, initial: list[torch.Tensor]) -> list[torch.Tensor]:
    """The applied steps in one process: each step's gradients at the parameters it began with, then
    each trainer's own optimizer (its momentum) in the order the server applied them."""
    model = _model()
    with torch.no_grad():
        for param, value in zip(model.parameters(), initial, strict=True):
            param.copy_(value)
    optimizers = {name: _optimizer(list(model.parameters())) for name in {entry[2] for entry in applied}}
    images, targets = _data()
    for _, group in itertools.groupby(applied, key=lambda entry: entry[0]):
        gradients = []
        for _, _, trainer, indices in group:
            model.zero_grad()
            nn.functional.mse_loss(model(images[indices]), targets[indices]).backward()
            gradients.append((trainer, [p.grad.clone() for p in model.parameters()]))
        for trainer, grads in gradients:
            for param, grad in zip(model.parameters(), grads, strict=True):
                param.grad = grad
            optimizers[trainer].step()
    return [p.detach() for p in model.parameters()]


def test_lost_trainers_batches_go_to_the_others_and_every_sample_is_applied_once() -> None:
    initial, final, applied = run_rpc_ranks(_train, 4, names=["ps", *TRAINERS], timeout=120,
                                            expect={2: "dies", 3: "dies"})[0]
    for epoch in range(EPOCHS):
        indices = sorted(i for _, e, _, batch in applied if e == epoch for i in batch)
        assert indices == list(range(SAMPLES)), f"epoch {epoch} applied {len(indices)} samples, not each once"
    by_trainer = {name: sum(1 for entry in applied if entry[2] == name) for name in TRAINERS}
    assert by_trainer["t3"] == HOLDING_DIES[1] - 1, by_trainer  # the batch it held was trained by another
    assert by_trainer["t2"] == ARRIVED_DIES[1] - 1, by_trainer  # so was the one whose step it had asked for
    for got, expected in zip(final, _replay(applied, initial), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_trainers_are_named_once() -> None:
    with pytest.raises(ValueError, match="each named once"):
        TrainerSteps(["a", "a"], samples=SAMPLES, batch_size=BATCH, epochs=EPOCHS)


# ---- a lost trainer's place taken by a worker that joins the running job ---------------------------


def _add_trainer(name: str) -> None:
    _server["steps"].add_trainer(name)


def _is_trainer(name: str) -> bool:
    steps = _server["steps"]
    with steps._lock:
        return name in steps._living


def _train_with_a_joiner(rank: int, world: int, port: int) -> tuple | None:
    """ps, t1, t2 and t3 start the job; t3 dies holding its second batch; t4 joins the running job
    (no world size), and takes part from then on. t1 holds its third step until t4 is a trainer."""
    options = rpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=30)
    name = ["ps", *TRAINERS, "t4"][rank]
    if name == "t4":
        rpc.init_rpc(name, rpc_backend_options=options)
    else:
        rpc.init_rpc(name, rank=rank, world_size=len(TRAINERS) + 1, rpc_backend_options=options)
    out = None
    if name == "ps":
        model, steps, _ = _handles()
        steps.local_value().wait(timeout=90)
        applied = [(b.step, b.epoch, b.trainer, b.indices.tolist()) for b in steps.local_value().applied]
        out = _server["initial"], [p.detach().clone() for p in model.local_value().parameters()], applied
    else:
        if name == "t4":
            wait_until(lambda: "t3" in {worker.name for worker in rpc.lost_workers()}, "t3 is lost", timeout=30)
            rpc.rpc_sync("ps", _add_trainer, args=("t4",))
        model, steps, params = rpc.rpc_sync("ps", _handles)
        optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=LR, momentum=0.9)
        images, targets = _data()
        for count in itertools.count(1):
            if (batch := steps.rpc_sync().next_batch(name)) is None:
                break
            with dist_autograd.context() as context_id:
                prediction = model.rpc_sync().forward(images[batch.indices])
                dist_autograd.backward(context_id, [nn.functional.mse_loss(prediction, targets[batch.indices])])
                if (name, count) == ("t3", 2):
                    os.kill(os.getpid(), signal.SIGKILL)
                if (name, count) == ("t1", 3):
                    wait_until(lambda: rpc.rpc_sync("ps", _is_trainer, args=("t4",)), "t4 is a trainer", timeout=30)
                steps.rpc_sync().step(batch, optimizer, context_id)
    rpc.shutdown()
    return out


def test_a_worker_that_joins_the_running_job_takes_a_lost_trainers_place() -> None:
    results = run_ranks(_train_with_a_joiner, len(TRAINERS) + 2, backend=None, timeout=120, expect={3: "dies"})
    initial, final, applied = results[0]
    for epoch in range(EPOCHS):
        indices = sorted(i for _, e, _, batch in applied if e == epoch for i in batch)
        assert indices == list(range(SAMPLES)), f"epoch {epoch} applied {len(indices)} samples, not each once"
    by_trainer = {name: sum(1 for entry in applied if entry[2] == name) for name in [*TRAINERS, "t4"]}
    assert by_trainer["t3"] == 1 and by_trainer["t4"] > 0, by_trainer  # its momentum is in the replay below
    for got, expected in zip(final, _replay(applied, initial), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


# ---- the server lost: made again on a trainer, from its live replica or its last checkpoint ----------

EVERY, SERVER_DIES_AFTER = 2, 20  # a checkpoint every 2 steps (6 batches); the server dies once 20 are applied
_failover: dict = {}


def _failover_handles(directory: str | None, replicas: int) -> tuple[rpc.RRef, rpc.RRef, list[rpc.RRef]]:
    """Runs on whichever worker serves: the model and steps, resumed from the replica this worker
    holds or the last checkpoint, if any."""
    with _made:
        if not _failover:
            model = _model()
            checkpoints = ModelParallelCheckpoint(directory, async_save=True) if directory else None
            steps = TrainerSteps(TRAINERS, samples=SAMPLES, batch_size=BATCH, epochs=EPOCHS, seed=5,
                                 checkpoints=checkpoints, modules={"model": rpc.RRef(model)}, every=EVERY,
                                 replicas=replicas)
            _failover.update(model=model, steps=steps, resumed_with=len(steps.applied))
        model = _failover["model"]
        return rpc.RRef(model), rpc.RRef(_failover["steps"]), [rpc.RRef(p) for p in model.parameters()]


def _train_through_failover(rank: int, world: int, directory: str | None, replicas: int) -> tuple:
    """Each trainer's batches whose steps it was told were applied; and from the worker that serves in
    the end, the parameters, the applied steps, and how many batches it resumed with."""
    name = ["t1", "ps", "t2", "t3"][rank]  # rank 0 serves the rendezvous store, so it is not the server
    if name == "ps":
        _, steps, _ = _failover_handles(directory, replicas)
        while len(steps.local_value().applied) < SERVER_DIES_AFTER or steps.local_value()._applying:
            time.sleep(0.005)  # until its trainers have heard that their steps were applied (white-box)
        os.kill(os.getpid(), signal.SIGKILL)
    server, confirmed = "ps", []
    images, targets = _data()
    while True:
        try:
            model, steps, params = rpc.rpc_sync(server, _failover_handles, args=(directory, replicas))
            optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=LR, momentum=0.9)
            while (batch := steps.rpc_sync().next_batch(name)) is not None:
                with dist_autograd.context() as context_id:
                    out = model.rpc_sync().forward(images[batch.indices])
                    dist_autograd.backward(context_id, [nn.functional.mse_loss(out, targets[batch.indices])])
                    steps.rpc_sync().step(batch, optimizer, context_id)
                confirmed.append((batch.step, batch.epoch, batch.trainer, batch.indices.tolist()))
            break
        except RuntimeError:
            if server not in {worker.name for worker in rpc.lost_workers()}:
                raise
            server = "t1"  # the first trainer by name serves from now on, on every trainer
    if name != server:
        return (confirmed,)
    steps = _failover["steps"]
    steps.wait(timeout=90)
    fresh = _model()
    checkpoints = ModelParallelCheckpoint(directory) if directory else None
    with pytest.raises(ValueError, match="not of this run"):  # another seed: refused before it restores anything
        TrainerSteps(TRAINERS, samples=SAMPLES, batch_size=BATCH, epochs=EPOCHS, seed=6, checkpoints=checkpoints,
                     modules={"model": rpc.RRef(fresh)}, every=EVERY, replicas=replicas)
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), _model().parameters(), strict=True))
    applied = [(b.step, b.epoch, b.trainer, b.indices.tolist()) for b in steps.applied]
    return confirmed, [p.detach().clone() for p in _failover["model"].parameters()], applied, _failover["resumed_with"]


def _check_applied_once_and_replayed(final: list[torch.Tensor], applied: list) -> None:
    for epoch in range(EPOCHS):
        indices = sorted(i for _, e, _, batch in applied if e == epoch for i in batch)
        assert indices == list(range(SAMPLES)), f"epoch {epoch} applied {len(indices)} samples, not each once"
    for got, expected in zip(final, _replay(applied, [p.detach() for p in _model().parameters()]), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_a_lost_server_is_made_again_on_a_trainer_from_its_last_checkpoint(tmp_path) -> None:
    results = run_rpc_ranks(_train_through_failover, 4, str(tmp_path), 0, names=["t1", "ps", "t2", "t3"],
                            timeout=120, expect={1: "dies"})
    _, final, applied, resumed_with = results[0]
    # Resumed from a checkpoint of a whole number of steps of three batches, the steps since lost.
    assert resumed_with >= 2 * EVERY * len(TRAINERS) and resumed_with % (EVERY * len(TRAINERS)) == 0, resumed_with
    _check_applied_once_and_replayed(final, applied)


def test_a_lost_server_is_made_again_from_its_replica_with_nothing_lost() -> None:
    results = run_rpc_ranks(_train_through_failover, 4, None, 1, names=["t1", "ps", "t2", "t3"],
                            timeout=120, expect={1: "dies"})
    _, final, applied, resumed_with = results[0]
    assert resumed_with >= SERVER_DIES_AFTER, resumed_with  # the replica on t1 had every step the server applied
    confirmed = [entry for rank in (0, 2, 3) for entry in results[rank][0]]
    assert [entry for entry in confirmed if entry not in applied] == []  # no step a trainer was told of is lost
    _check_applied_once_and_replayed(final, applied)
