"""A model pipelined over RPC on the digits: an MLP cut into two shards that live on two workers,
driven through RRefs by a master that splits each batch into micro-batches, so that shard 1 works
on one micro-batch while shard 2 works on the one before. Distributed autograd carries the
gradients back through both shards and a DistributedOptimizer updates them. The master also trains
the unsplit model on the same batches: the micro-batches' gradients add up to the whole batch's,
so both end with the same weights.

With --checkpoint-dir, the master checkpoints both shards, the optimizer's state on their workers
and its own reference model after every epoch, and resumes from the latest checkpoint when it
starts: under `shoal run --max-restarts 1`, a job that lost any of its workers starts again and
goes on from the last epoch it finished.

    shoal run --nproc-per-node 3 examples/rpc_pipeline.py                 # master + 2 shards
    shoal run --nproc-per-node 3 examples/rpc_pipeline.py --microbatches 8
    shoal run --nproc-per-node 3 --max-restarts 1 examples/rpc_pipeline.py --checkpoint-dir ckpt
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

from shoal import autograd as dist_autograd
from shoal import rpc
from shoal.checkpoint import ModelParallelCheckpoint
from shoal.demo import digits
from shoal.optim import DistributedOptimizer


def whole_model() -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights wherever it is built
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                         nn.Linear(64, 10))


class Shard(nn.Module):
    """Layers [start, stop) of the whole model, on the worker this is created on."""

    def __init__(self, start: int, stop: int) -> None:
        super().__init__()
        self.layers = whole_model()[start:stop]

    def forward(self, x_rref: rpc.RRef) -> torch.Tensor:
        return self.layers(x_rref.to_here())

    def parameter_rrefs(self) -> list[rpc.RRef]:
        return [rpc.RRef(param) for param in self.parameters()]


class PipelinedModel(nn.Module):
    """Each micro-batch goes to shard 1, whose output stays there (an RRef) and is fetched by
    shard 2; calls are asynchronous, so micro-batches overlap across the shards."""

    def __init__(self, microbatches: int) -> None:
        super().__init__()
        self.microbatches = microbatches
        self.first = rpc.remote("shard1", Shard, args=(0, 4))
        self.second = rpc.remote("shard2", Shard, args=(4, 6))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        outputs = []
        for chunk in images.chunk(self.microbatches):
            hidden = self.first.remote().forward(rpc.RRef(chunk))
            outputs.append(self.second.rpc_async().forward(hidden))
        return torch.cat(torch.futures.wait_all(outputs))

    def parameter_rrefs(self) -> list[rpc.RRef]:
        return self.first.rpc_sync().parameter_rrefs() + self.second.rpc_sync().parameter_rrefs()

    def shards(self) -> dict[str, rpc.RRef]:
        return {"first": self.first, "second": self.second}


def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(images).argmax(dim=1) == labels).double().mean().item()


def train(args: argparse.Namespace) -> None:
    model = PipelinedModel(args.microbatches)
    optimizer = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=args.lr, momentum=0.9)
    reference = whole_model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=args.lr, momentum=0.9)
    (images, labels), (test_images, test_labels) = (data.tensors for data in digits())
    checkpoints = ModelParallelCheckpoint(args.checkpoint_dir, async_save=True) if args.checkpoint_dir else None
    first_epoch = 0
    latest = checkpoints.load_latest(model.shards(), optimizer) if checkpoints else None
    if latest is not None:
        reference.load_state_dict(latest.state["reference"])
        reference_optimizer.load_state_dict(latest.state["reference_optimizer"])
        first_epoch = latest.step
        print(f"resuming from {latest.path.name}: epoch {first_epoch}", flush=True)
    for epoch in range(first_epoch, args.epochs):
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
        total = 0.0
        for start in range(0, len(order), args.batch_size):
            x, y = images[order[start:start + args.batch_size]], labels[order[start:start + args.batch_size]]
            with dist_autograd.context() as context_id:
                loss = nn.functional.cross_entropy(model(x), y)
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
            total += loss.item() * len(y)
            reference_optimizer.zero_grad()
            nn.functional.cross_entropy(reference(x), y).backward()
            reference_optimizer.step()
        print(f"epoch {epoch}: loss {total / len(order):.4f}, test accuracy pipelined "
              f"{accuracy(model, test_images, test_labels):.2%}, unsplit "
              f"{accuracy(reference, test_images, test_labels):.2%}", flush=True)
        if checkpoints:
            checkpoints.save(epoch + 1, model.shards(), optimizer, extra={
                "reference": reference.state_dict(), "reference_optimizer": reference_optimizer.state_dict()})
    if checkpoints:
        checkpoints.wait()
    trained = [rref.to_here() for rref in model.parameter_rrefs()]
    gap = max((p - q).abs().max().item() for p, q in zip(trained, reference.parameters(), strict=True))
    print(f"final test accuracy: pipelined {accuracy(model, test_images, test_labels):.2%}, "
          f"unsplit {accuracy(reference, test_images, test_labels):.2%}", flush=True)
    print(f"largest parameter difference from the unsplit model: {gap:.2e}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--checkpoint-dir", help="checkpoint every epoch here, and resume from the latest")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # set by `shoal run`
    if world_size != 3:
        raise SystemExit(f"rpc_pipeline.py runs on 3 workers (a master and 2 shards), not {world_size}")
    rpc.init_rpc("master" if rank == 0 else f"shard{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        train(args)
    rpc.shutdown()
