"""The parameter-server job `benchmarks/rpc_recovery.py` kills a trainer of: a server (rank 0) and three
trainers train an MLP on the digits over RPC with distributed autograd and a DistributedOptimizer.

`--impl shoal` (under `shoal run --live`): the server runs the steps with TrainerSteps, so the other
trainers go on without a lost one. `--impl torch` (under torchrun --max-restarts 1): the same job on
torch.distributed.rpc, the trainers held in step by a barrier on the server, as PyTorch's parameter
server examples are; a lost trainer ends the job, and torchrun starts it again from the beginning.

Trainer rank 2 prints `death T` and SIGKILLs itself between its backward and its step in step
`--kill-at`, in the first attempt; every trainer prints `applied S T` once its step S is applied.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import torch
from torch import nn
from torch.distributed.rpc.functions import async_execution

from shoal.demo import digits

TRAINERS = ["trainer1", "trainer2", "trainer3"]
BATCH = 32


def _first_attempt() -> bool:
    return os.environ.get("SHOAL_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == "0"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def _maybe_die(rank: int, step: int, kill_at: int) -> None:
    if rank == 2 and step == kill_at and _first_attempt():
        print(f"death {time.time():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class Server:
    """The model, and (shoal) TrainerSteps or (torch) a barrier for the trainers."""

    def __init__(self, impl: str, steps: int) -> None:
        self.model = _model()
        if impl == "shoal":
            from shoal.elastic import TrainerSteps

            self.steps = TrainerSteps(TRAINERS, samples=BATCH * len(TRAINERS) * steps, batch_size=BATCH, epochs=1)
        self.lock = threading.Lock()
        self.arrived = 0
        self.everyone_arrived = torch.futures.Future()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def parameters(self, rref_class: type) -> list:
        return [rref_class(p) for p in self.model.parameters()]

    def barrier(self) -> torch.futures.Future:
        with self.lock:
            this_round = self.everyone_arrived
            self.arrived += 1
            if self.arrived == len(TRAINERS):
                self.arrived, self.everyone_arrived = 0, torch.futures.Future()
                this_round.set_result(None)
        return this_round


_server: list = []
_made = threading.Lock()


def server(impl: str, steps: int, rref_class: type) -> object:
    with _made:
        if not _server:
            _server.append(rref_class(Server(impl, steps)))
        return _server[0]


def _steps_of(server_rref: object) -> object:
    return server_rref.local_value().steps


def _parameters_of(server_rref: object, rref_class: type) -> list:
    return server_rref.local_value().parameters(rref_class)


@async_execution  # torch's: only --impl torch calls it
def _barrier(server_rref: object) -> torch.futures.Future:
    return server_rref.local_value().barrier()


def train_shoal(rank: int, args: argparse.Namespace) -> None:
    from shoal import autograd as dist_autograd
    from shoal import rpc
    from shoal.optim import DistributedOptimizer

    images, labels = digits()[0].tensors
    ps = rpc.rpc_sync("ps", server, args=("shoal", args.steps, rpc.RRef))
    steps = rpc.remote("ps", _steps_of, args=(ps,))
    optimizer = DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync("ps", _parameters_of, args=(ps, rpc.RRef)),
                                     lr=0.05, momentum=0.9)
    name = TRAINERS[rank - 1]
    while (batch := steps.rpc_sync().next_batch(name)) is not None:
        indices = batch.indices % len(labels)
        with dist_autograd.context() as context_id:
            loss = nn.functional.cross_entropy(ps.rpc_sync().forward(images[indices]), labels[indices])
            dist_autograd.backward(context_id, [loss])
            _maybe_die(rank, batch.step, args.kill_at)
            steps.rpc_sync().step(batch, optimizer, context_id)
        print(f"applied {batch.step} {time.time():.6f}", flush=True)


def train_torch(rank: int, args: argparse.Namespace) -> None:
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer

    images, labels = digits()[0].tensors
    ps = rpc.rpc_sync("ps", server, args=("torch", args.steps, rpc.RRef))
    optimizer = DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync("ps", _parameters_of, args=(ps, rpc.RRef)),
                                     lr=0.05, momentum=0.9)
    order = torch.randperm(BATCH * len(TRAINERS) * args.steps, generator=torch.Generator().manual_seed(0))
    for step in range(args.steps):
        chosen = order[(step * len(TRAINERS) + rank - 1) * BATCH:][:BATCH] % len(labels)
        with dist_autograd.context() as context_id:
            loss = nn.functional.cross_entropy(ps.rpc_sync().forward(images[chosen]), labels[chosen])
            dist_autograd.backward(context_id, [loss])
            _maybe_die(rank, step, args.kill_at)
            rpc.rpc_sync("ps", _barrier, args=(ps,))
            optimizer.step(context_id)
            rpc.rpc_sync("ps", _barrier, args=(ps,))
        print(f"applied {step} {time.time():.6f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["shoal", "torch"], required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.impl == "shoal":
        from shoal import rpc
    else:
        import torch.distributed.rpc as rpc
    rpc.init_rpc("ps" if rank == 0 else TRAINERS[rank - 1], rank=rank, world_size=world)
    if rank > 0:
        (train_shoal if args.impl == "shoal" else train_torch)(rank, args)
    rpc.shutdown()


if __name__ == "__main__":
    main()
