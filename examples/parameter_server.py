"""A parameter server and its trainers on the digits. The model lives on the parameter server
(rank 0, "ps"); each trainer (ranks 1 and up) runs its forward there over RPC, backpropagates
through it with distributed autograd and updates it with a DistributedOptimizer, each in its own
distributed autograd context.

The server also deals out the work (`shoal.elastic.TrainerSteps`): each step, every trainer gets a
batch, and once all have run their backward, the server applies their optimizer steps, so no step
changes the weights under a backward still to run through them. A trainer that dies mid-step costs
nothing but time: its batch goes to another trainer, and every sample is still trained on once
per epoch. Under `shoal run --live`, the launcher lets the others go on without it; with
`--max-restarts K`, it starts a replacement, which joins the running job under a name of its own
(trainerR.N: rank R's N-th restart) and trains with the others from the next step.

With --checkpoint-dir, the server checkpoints the model, the trainers' optimizers and its place in
the epochs every --checkpoint-every steps; with --replicas K, it sends all of that to the first K
trainers after every step. With --live as well, if the server dies, the trainers make it again on
the first of them that lives, which serves and trains both from then on. It goes on from its
replica (nothing is lost) or else from the last checkpoint (the steps since are trained again).

    shoal run --nproc-per-node 3 examples/parameter_server.py            # a server, two trainers
    shoal run --nproc-per-node 4 examples/parameter_server.py --epochs 8
    shoal run --live --nproc-per-node 4 examples/parameter_server.py    # survives lost trainers
    shoal run --live --max-restarts 2 --nproc-per-node 4 examples/parameter_server.py   # and replaces them
    shoal run --live --nproc-per-node 4 examples/parameter_server.py --checkpoint-dir ckpt --live   # and its server
    shoal run --live --nproc-per-node 4 examples/parameter_server.py --replicas 1 --live            # losing nothing
"""

from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Callable

import torch
from torch import nn

from shoal import autograd as dist_autograd
from shoal import rpc
from shoal.checkpoint import ModelParallelCheckpoint
from shoal.demo import digits
from shoal.elastic import TrainerSteps
from shoal.optim import DistributedOptimizer


class ParameterServer:
    """Holds the model and the trainers' steps."""

    def __init__(self, trainers: list[str], args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        samples = len(digits()[0])
        checkpoints = ModelParallelCheckpoint(args.checkpoint_dir, async_save=True) if args.checkpoint_dir else None
        self.steps = TrainerSteps(trainers, samples=samples, batch_size=args.batch_size, epochs=args.epochs,
                                  checkpoints=checkpoints, modules={"model": rpc.RRef(self.model)},
                                  every=args.checkpoint_every, replicas=args.replicas)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def parameter_rrefs(self) -> list[rpc.RRef]:
        return [rpc.RRef(param) for param in self.model.parameters()]

    def steps_rref(self) -> rpc.RRef:
        return rpc.RRef(self.steps)

    def accuracy(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        with torch.no_grad():
            return (self.model(images).argmax(dim=1) == labels).double().mean().item()


_server: list[rpc.RRef] = []
_server_lock = threading.Lock()


def parameter_server(trainers: list[str], args: argparse.Namespace) -> rpc.RRef:
    """The one ParameterServer, made by the first worker that asks (runs on the server)."""
    with _server_lock:
        if not _server:
            _server.append(rpc.RRef(ParameterServer(trainers, args)))
        return _server[0]


def train(name: str, trainers: list[str], args: argparse.Namespace,
          after_backward: Callable[[str, int], None] | None) -> None:
    """Train until every epoch is done; with --live and --checkpoint-dir or --replicas, a lost server is
    made again on the first trainer not known to be lost (which holds its replica, if it has one)."""
    if args.live:  # torch imports torch._dynamo (a second or more) where a process makes its first optimizer:
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # not while the others wait for this one
    host = "ps"
    while True:
        try:
            train_with(host, name, trainers, args, after_backward)
            break
        except RuntimeError:  # PeerFailure, or an error a lost worker caused
            lost = {worker.name for worker in rpc.lost_workers()}
            if not (args.live and (args.checkpoint_dir or args.replicas) and host in lost):
                raise
            trainers = [trainer for trainer in trainers if trainer not in lost]
            print(f"{name}: the server on {host} is lost; {trainers[0]} serves from now on", flush=True)
            host = trainers[0]
    if host == name:
        serve(trainers, args)


def train_with(host: str, name: str, trainers: list[str], args: argparse.Namespace,
               after_backward: Callable[[str, int], None] | None) -> None:
    server = rpc.rpc_sync(host, parameter_server, args=(trainers, args))
    steps = server.rpc_sync().steps_rref()
    if name not in trainers:  # a replacement that joined the job
        steps.rpc_sync().add_trainer(name)
    optimizer = DistributedOptimizer(torch.optim.SGD, server.rpc_sync().parameter_rrefs(), lr=args.lr, momentum=0.9)
    images, labels = digits()[0].tensors
    epoch, losses = 0, []
    while (batch := steps.rpc_sync().next_batch(name)) is not None:
        if batch.epoch != epoch and losses:
            print(f"{name}, epoch {epoch}: loss {sum(losses) / len(losses):.4f} over {len(losses)} batches", flush=True)
            losses = []
        epoch = batch.epoch
        with dist_autograd.context() as context_id:
            loss = nn.functional.cross_entropy(server.rpc_sync().forward(images[batch.indices]), labels[batch.indices])
            dist_autograd.backward(context_id, [loss])
            if after_backward is not None:
                after_backward(name, batch.step)
            steps.rpc_sync().step(batch, optimizer, context_id)  # once every trainer's backward is done
        losses.append(loss.item())
    if losses:
        print(f"{name}, epoch {epoch}: loss {sum(losses) / len(losses):.4f} over {len(losses)} batches", flush=True)


def serve(trainers: list[str], args: argparse.Namespace) -> None:
    server = parameter_server(trainers, args)
    if (resumed := server.local_value().steps.resumed) is not None:
        print(f"serving from {resumed.path}, step {resumed.step}", flush=True)
    server.local_value().steps.wait()
    test_images, test_labels = digits()[1].tensors
    print(f"final test accuracy: {server.local_value().accuracy(test_images, test_labels):.2%}", flush=True)


def main(argv: list[str] | None = None, after_backward: Callable[[str, int], None] | None = None) -> None:
    """`after_backward(trainer, step)` runs on each trainer between its backward and its step (a test
    kills a trainer there)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-dir", help="the server checkpoints here, and starts from the latest")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--replicas", type=int, default=0, help="trainers the server replicates to after every step")
    parser.add_argument("--live", action="store_true",
                        help="with --checkpoint-dir or --replicas: make a lost server again on a trainer and go on")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # set by `shoal run`
    trainers = [f"trainer{r}" for r in range(1, world_size)]
    restart = int(os.environ.get("SHOAL_RESTART_COUNT", "0"))
    if restart > 0 and os.environ.get("SHOAL_LIVE") == "1":  # under --live, it replaces one lost worker
        name = f"trainer{rank}.{restart}"  # with no world size: it joins the running job
        store = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        rpc.init_rpc(name, rpc_backend_options=rpc.RpcBackendOptions(init_method=store))
    else:
        name = "ps" if rank == 0 else trainers[rank - 1]
        rpc.init_rpc(name, rank=rank, world_size=world_size)
    if name == "ps":
        serve(trainers, args)
    else:
        train(name, trainers, args, after_backward)
    rpc.shutdown()  # the server serves until every trainer is done; a replacement leaves when it is


if __name__ == "__main__":
    main()
