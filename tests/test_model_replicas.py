"""ModelReplicas between real workers: an owner replicates its model and Adam's state to two
workers; one of them dies, and the next save names it (ReplicaLost) while the other still takes it.
The owner finds the newest replica among the two (the dead one passed over), and the survivor
restores it into a model of its own: both train on to the same parameters (float64, exactly)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import pytest
import torch
from torch import nn

from shoal import autograd as dist_autograd
from shoal import rpc
from shoal.checkpoint import ModelReplicas, ReplicaLost
from shoal.errors import PeerFailure
from shoal.optim import DistributedOptimizer
from tests.ranks import run_rpc_ranks
from tests.waiting import wait_until

NAME = "model"
_found = threading.Event()  # on w1: the owner has found the newest replica (w1's), so w1 may restore it
_saved = threading.Event()  # on w2: the owner's first save has returned (w2 answered it), so w2 may die


def _owner_found_it() -> None:
    _found.set()


def _owner_saved() -> None:
    _saved.set()


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _step(model: nn.Module, optimizer: DistributedOptimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x, y = (torch.randn(6, 5, generator=generator, dtype=torch.float64),
            torch.randn(6, 2, generator=generator, dtype=torch.float64))
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [nn.functional.mse_loss(model(x), y)])
        optimizer.step(context_id)



def _worker(rank: int, world: int) -> list[torch.Tensor] | None:
    name = rpc.get_worker_info().name
    if name == "w2":  # dies once it holds the first replica, and the owner has heard so
        assert _saved.wait(timeout=30) and ModelReplicas(NAME).held_step() == 2
        os.kill(os.getpid(), signal.SIGKILL)
    model = _model(seed=0 if name == "w0" else 1)
    optimizer = DistributedOptimizer(torch.optim.Adam, [rpc.RRef(p) for p in model.parameters()], lr=0.05)
    if name == "w0":
        with pytest.raises(ValueError, match="its own worker"):
            ModelReplicas(NAME, ["w1", "w0"])
        replicas = ModelReplicas(NAME, ["w1", "w2"])
        for seed in range(2):
            _step(model, optimizer, seed)
        replicas.save(2, {"model": rpc.RRef(model)}, optimizer, extra={"epoch": 0})
        with contextlib.suppress(PeerFailure):  # w2 dies once told, maybe before its answer is sent
            rpc.rpc_sync("w2", _owner_saved)
        wait_until(lambda: rpc.get_worker_info("w2") in rpc.lost_workers(), "w2 is lost", timeout=30)
        _step(model, optimizer, 2)
        with pytest.raises(ReplicaLost, match="could not be kept on w2") as lost:
            replicas.save(3, {"model": rpc.RRef(model)}, optimizer, extra={"epoch": 1})
        assert lost.value.workers == ["w2"]
        newest = ModelReplicas(NAME).latest(among=["w2", "w1"])  # w2 is gone: passed over
        assert (newest.step, newest.path, newest.state["extra"]) == (3, "the replica 'model' on w1", {"epoch": 1})
        rpc.rpc_sync("w1", _owner_found_it)
    else:  # w1: takes the owner's place from the replica of step 3
        assert ModelReplicas("another").load_latest({"model": rpc.RRef(model)}) is None
        assert _found.wait(timeout=30)
        latest = ModelReplicas(NAME).load_latest({"model": rpc.RRef(model)}, optimizer)
        assert (latest.step, latest.state, latest.path) == (3, {"epoch": 1}, "the replica 'model' on w1")
        assert ModelReplicas(NAME).held_step() is None  # let go, once restored
    _step(model, optimizer, 3)  # Adam's moments and step count came along: the same step on both
    return [p.detach().clone() for p in model.parameters()]


def test_a_replica_survives_its_owner_and_a_lost_replica_is_named() -> None:
    results = run_rpc_ranks(_worker, 3, names=["w0", "w1", "w2"], timeout=90, expect={2: "dies"})
    for owner, replica in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(replica, owner, rtol=0, atol=0)
