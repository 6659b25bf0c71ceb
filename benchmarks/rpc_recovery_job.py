"""The parameter-server job `benchmarks/rpc_recovery.py` kills a trainer of: a server (rank 0) and three
trainers train an MLP on the digits over RPC with distributed autograd and a DistributedOptimizer.

`--impl shoal` (under `shoal run --live`): the server runs the steps with TrainerSteps, so the other
trainers go on without a lost one; with `--victim server`, it checkpoints every `--every` steps (with
`--checkpoint-dir`) or replicates to trainer1 after every step (`--replicas 1`), and the trainers
make it again on trainer1 when it dies. `--impl torch` (under torchrun --max-restarts
1): the same job on torch.distributed.rpc, the trainers held in step by a barrier on the server, as
PyTorch's parameter server examples are; a lost trainer ends the job, and torchrun starts it again
from the beginning.

Trainer rank 2 (or with `--victim server`, the server) prints `death T` and SIGKILLs itself in step
`--kill-at` (a trainer between its backward and its step; the server once it has applied it), in
the first attempt; every trainer prints `applied S T` once its step S is applied (shoal: `applied S T
on HOST`, HOST the server's worker).
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


def _die() -> None:
    print(f"death {time.time():.6f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _maybe_die(rank: int, step: int, args: argparse.Namespace) -> None:
    if args.victim == "trainer" and rank == 2 and step == args.kill_at and _first_attempt():
        _die()


class Server:
    """The model, and (shoal) TrainerSteps or (torch) a barrier for the trainers."""

    def __init__(self, impl: str, trainers: list[str], args: argparse.Namespace, rref_class: type) -> None:
        self.model = _model()
        if impl == "shoal":
            from shoal.checkpoint import ModelParallelCheckpoint
            from shoal.elastic import TrainerSteps

            checkpoints = ModelParallelCheckpoint(args.checkpoint_dir, async_save=True) if args.checkpoint_dir else None
            self.steps = TrainerSteps(trainers, samples=BATCH * len(TRAINERS) * args.steps, batch_size=BATCH, epochs=1,
                                      checkpoints=checkpoints, modules={"model": rref_class(self.model)},
                                      every=args.every, replicas=args.replicas)
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


def server(impl: str, trainers: list[str], args: argparse.Namespace, rref_class: type) -> object:
    with _made:
        if not _server:
            _server.append(rref_class(Server(impl, trainers, args, rref_class)))
        return _server[0]


def _die_after(kill_at: int) -> None:
    """On the server: the kill once step `kill_at` is applied."""
    steps = _server[0].local_value().steps
    while not steps.applied or steps.applied[-1].step < kill_at:
        time.sleep(0.001)
    _die()


def _steps_of(server_rref: object) -> object:
    return server_rref.local_value().steps


def _parameters_of(server_rref: object, rref_class: type) -> list:
    return server_rref.local_value().parameters(rref_class)


@async_execution  # torch's: only --impl torch calls it
def _barrier(server_rref: object) -> torch.futures.Future:
    return server_rref.local_value().barrier()


def train_shoal(rank: int, args: argparse.Namespace) -> None:
    """With a lost server, its trainers make it again on the first of them that lives."""
    from shoal import rpc

    if args.victim == "server":  # as examples/parameter_server.py does: see there
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    host, trainers = "ps", TRAINERS
    while True:
        try:
            train_shoal_with(host, trainers, rank, args)
            return
        except RuntimeError:
            lost = {worker.name for worker in rpc.lost_workers()}
            if host not in lost:
                raise
            trainers = [trainer for trainer in trainers if trainer not in lost]
            host = trainers[0]


def train_shoal_with(host: str, trainers: list[str], rank: int, args: argparse.Namespace) -> None:
    from shoal import autograd as dist_autograd
    from shoal import rpc
    from shoal.optim import DistributedOptimizer

    images, labels = digits()[0].tensors
    ps = rpc.rpc_sync(host, server, args=("shoal", trainers, args, rpc.RRef))
    steps = rpc.remote(host, _steps_of, args=(ps,))
    optimizer = DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync(host, _parameters_of, args=(ps, rpc.RRef)),
                                     lr=0.05, momentum=0.9)
    name = TRAINERS[rank - 1]
    while (batch := steps.rpc_sync().next_batch(name)) is not None:
        indices = batch.indices % len(labels)
        with dist_autograd.context() as context_id:
            loss = nn.functional.cross_entropy(ps.rpc_sync().forward(images[indices]), labels[indices])
            dist_autograd.backward(context_id, [loss])
            _maybe_die(rank, batch.step, args)
            steps.rpc_sync().step(batch, optimizer, context_id)
        print(f"applied {batch.step} {time.time():.6f} on {host}", flush=True)


def train_torch(rank: int, args: argparse.Namespace) -> None:
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer

    images, labels = digits()[0].tensors
    ps = rpc.rpc_sync("ps", server, args=("torch", TRAINERS, args, rpc.RRef))
    optimizer = DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync("ps", _parameters_of, args=(ps, rpc.RRef)),
                                     lr=0.05, momentum=0.9)
    order = torch.randperm(BATCH * len(TRAINERS) * args.steps, generator=torch.Generator().manual_seed(0))
    for step in range(args.steps):
        chosen = order[(step * len(TRAINERS) + rank - 1) * BATCH:][:BATCH] % len(labels)
        with dist_autograd.context() as context_id:
            loss = nn.functional.cross_entropy(ps.rpc_sync().forward(images[chosen]), labels[chosen])
            dist_autograd.backward(context_id, [loss])
            _maybe_die(rank, step, args)
            rpc.rpc_sync("ps", _barrier, args=(ps,))
            optimizer.step(context_id)
            rpc.rpc_sync("ps", _barrier, args=(ps,))
        print(f"applied {step} {time.time():.6f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["shoal", "torch"], required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=20)
    parser.add_argument("--victim", choices=["trainer", "server"], default="trainer")
    parser.add_argument("--checkpoint-dir", help="--impl shoal: the server checkpoints here")
    parser.add_argument("--every", type=int, default=5, help="steps between the server's checkpoints")
    parser.add_argument("--replicas", type=int, default=0, help="--impl shoal: trainers the server replicates to")
    args = parser.parse_args()
    if args.victim == "server" and (args.impl != "shoal" or not (args.checkpoint_dir or args.replicas)):
        parser.error("--victim server needs --impl shoal and --checkpoint-dir or --replicas")
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.impl == "shoal":
        from shoal import rpc
    else:
        import torch.distributed.rpc as rpc
    rpc.init_rpc("ps" if rank == 0 else TRAINERS[rank - 1], rank=rank, world_size=world)
    if rank == 0 and args.victim == "server" and _first_attempt():
        server(args.impl, TRAINERS, args, rpc.RRef)
        threading.Thread(target=_die_after, args=(args.kill_at,), daemon=True).start()
    if rank > 0:
        (train_shoal if args.impl == "shoal" else train_torch)(rank, args)
    rpc.shutdown()


if __name__ == "__main__":
    main()
