"""A parameter server and its trainers on the digits. The model lives on the parameter server
(rank 0, "ps"); each trainer (ranks 1 and up) runs its forward there over RPC, backpropagates
through it with distributed autograd and updates it with a DistributedOptimizer, each in its own
distributed autograd context.

    shoal run --nproc-per-node 3 examples/parameter_server.py            # a server, two trainers
    shoal run --nproc-per-node 4 examples/parameter_server.py --epochs 8
"""

from __future__ import annotations

import argparse
import os
import threading

import torch
from torch import nn

from shoal import autograd as dist_autograd
from shoal import rpc
from shoal.demo import digits
from shoal.optim import DistributedOptimizer


class ParameterServer:
    """Holds the model. Trainers take turns only where they must: an optimizer step changes the
    weights in place, which a backward still to run through them would refuse (autograd checks
    saved tensors' versions), so steps happen between two barriers that all trainers reach."""

    def __init__(self, trainers: int) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.trainers = trainers
        self.lock = threading.Lock()
        self.arrived = 0
        self.everyone_arrived = torch.futures.Future()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def parameter_rrefs(self) -> list[rpc.RRef]:
        return [rpc.RRef(param) for param in self.model.parameters()]

    @rpc.functions.async_execution
    def barrier(self) -> torch.futures.Future:
        """Answers every trainer once all have called; a waiting trainer holds no server thread."""
        with self.lock:
            this_round = self.everyone_arrived
            self.arrived += 1
            if self.arrived == self.trainers:
                self.arrived, self.everyone_arrived = 0, torch.futures.Future()
                this_round.set_result(None)
        return this_round

    def accuracy(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        with torch.no_grad():
            return (self.model(images).argmax(dim=1) == labels).double().mean().item()


_server: list[rpc.RRef] = []
_server_lock = threading.Lock()


def parameter_server(trainers: int) -> rpc.RRef:
    """The one ParameterServer, made by the first trainer that asks (runs on the server)."""
    with _server_lock:
        if not _server:
            _server.append(rpc.RRef(ParameterServer(trainers)))
        return _server[0]


class TrainerNet(nn.Module):
    """The trainer's view of the model: a forward that runs on the parameter server."""

    def __init__(self, server: rpc.RRef) -> None:
        super().__init__()
        self.server = server

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.server.rpc_sync().forward(images)


def train(rank: int, trainers: int, args: argparse.Namespace) -> None:
    server = rpc.rpc_sync("ps", parameter_server, args=(trainers,))
    net = TrainerNet(server)
    optimizer = DistributedOptimizer(torch.optim.SGD, server.rpc_sync().parameter_rrefs(), lr=args.lr, momentum=0.9)
    (images, labels), (test_images, test_labels) = (data.tensors for data in digits())
    shard = torch.arange(rank - 1, len(labels), trainers)  # this trainer's share of the samples
    batches = len(labels) // trainers // args.batch_size  # the same number on every trainer (barriers)
    for epoch in range(args.epochs):
        order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(epoch))]
        total = 0.0
        for index in range(batches):
            chosen = order[index * args.batch_size:(index + 1) * args.batch_size]
            with dist_autograd.context() as context_id:
                loss = nn.functional.cross_entropy(net(images[chosen]), labels[chosen])
                dist_autograd.backward(context_id, [loss])
                server.rpc_sync().barrier()  # every trainer's backward is done: weights may change
                optimizer.step(context_id)
                server.rpc_sync().barrier()  # every step is done: the next forwards see them all
            total += loss.item()
        print(f"trainer {rank}, epoch {epoch}: loss {total / batches:.4f}", flush=True)
    if rank == 1:
        accuracy = server.rpc_sync().accuracy(test_images, test_labels)
        print(f"final test accuracy: {accuracy:.2%}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # set by `shoal run`
    rpc.init_rpc("ps" if rank == 0 else f"trainer{rank}", rank=rank, world_size=world_size)
    if rank > 0:
        train(rank, world_size - 1, args)
    rpc.shutdown()  # the server serves until every trainer is done
