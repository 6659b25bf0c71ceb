"""A model pipelined over RPC on the digits: an MLP cut into two shards that live on two workers,
driven through RRefs by a master that splits each batch into micro-batches, so that shard 1 works
on one micro-batch while shard 2 works on the one before. Distributed autograd carries the
gradients back through both shards and a DistributedOptimizer updates them. The master also trains
the unsplit model on the same batches: the micro-batches' gradients add up to the whole batch's,
so both end with the same weights.

With --checkpoint-dir, the master checkpoints both shards, the optimizer's state on their workers
and its own reference model after every epoch, and resumes from the latest checkpoint when it
starts: under `shoal run --max-restarts 1`, a job that lost any of its workers starts again and
goes on from the last epoch it finished. With --live as well, under `shoal run --live`, nothing is
restarted: when a shard's worker dies, the master builds that shard again on the other one, puts
both shards and its own model back as the last checkpoint has them, and goes on from there (the
master itself must live).

    shoal run --nproc-per-node 3 examples/rpc_pipeline.py                 # master + 2 shards
    shoal run --nproc-per-node 3 examples/rpc_pipeline.py --microbatches 8
    shoal run --nproc-per-node 3 --max-restarts 1 examples/rpc_pipeline.py --checkpoint-dir ckpt
    shoal run --live --nproc-per-node 3 examples/rpc_pipeline.py --checkpoint-dir ckpt --live
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

    LAYERS = {"first": (0, 4), "second": (4, 6)}

    def __init__(self, microbatches: int) -> None:
        super().__init__()
        self.microbatches = microbatches
        self.placed = {"first": rpc.remote("shard1", Shard, args=self.LAYERS["first"]),
                       "second": rpc.remote("shard2", Shard, args=self.LAYERS["second"])}

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        outputs = []
        for chunk in images.chunk(self.microbatches):
            hidden = self.placed["first"].remote().forward(rpc.RRef(chunk))
            outputs.append(self.placed["second"].rpc_async().forward(hidden))
        return torch.cat(torch.futures.wait_all(outputs))

    def parameter_rrefs(self) -> list[rpc.RRef]:
        return [rref for shard in self.placed.values() for rref in shard.rpc_sync().parameter_rrefs()]

    def shards(self) -> dict[str, rpc.RRef]:
        return dict(self.placed)

    def rebuild(self, lost: set[str]) -> list[str]:
        """Build the shards whose workers are in `lost` again on a worker that lives (their weights
        as at the start: a checkpoint puts them back); the keys of those rebuilt."""
        living = sorted({shard.owner_name() for shard in self.placed.values()} - lost)
        if not living:
            raise RuntimeError(f"every shard's worker is lost ({sorted(lost)}): nowhere to rebuild the model")
        rebuilt = [key for key, shard in self.placed.items() if shard.owner_name() in lost]
        for key in rebuilt:
            self.placed[key] = rpc.remote(living[0], Shard, args=self.LAYERS[key])
        return rebuilt


def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(images).argmax(dim=1) == labels).double().mean().item()


class Reference:
    """The unsplit model and its optimizer, trained on the master beside the pipelined one."""

    def __init__(self, lr: float) -> None:
        self.model = whole_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        nn.functional.cross_entropy(self.model(x), y).backward()
        self.optimizer.step()

    def state_dict(self) -> dict:
        return {"reference": self.model.state_dict(), "reference_optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["reference"])
        self.optimizer.load_state_dict(state["reference_optimizer"])


def train(args: argparse.Namespace) -> None:
    model = PipelinedModel(args.microbatches)
    optimizer = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=args.lr, momentum=0.9)
    reference = Reference(args.lr)
    checkpoints = ModelParallelCheckpoint(args.checkpoint_dir, async_save=True) if args.checkpoint_dir else None
    first_epoch = resume(checkpoints, model, optimizer, reference)
    if checkpoints and first_epoch == 0:  # so that a shard lost in epoch 0 is rebuilt as the others are reset
        checkpoints.save(0, model.shards(), optimizer, extra=reference.state_dict())
    while True:
        try:
            train_epochs(args, range(first_epoch, args.epochs), model, optimizer, reference, checkpoints)
            break
        except RuntimeError:  # PeerFailure, or what torch.futures.wait_all makes of one
            lost = {worker.name for worker in rpc.lost_workers()}
            if not (args.live and checkpoints and lost & {shard.owner_name() for shard in model.placed.values()}):
                raise
            rebuilt = model.rebuild(lost)
            print(f"lost {sorted(lost)}: shard(s) {rebuilt} built again on "
                  f"{sorted({model.placed[key].owner_name() for key in rebuilt})}", flush=True)
            optimizer = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=args.lr, momentum=0.9)
            reference = Reference(args.lr)
            first_epoch = resume(checkpoints, model, optimizer, reference)
    (_, _), (test_images, test_labels) = (data.tensors for data in digits())
    trained = [rref.to_here() for rref in model.parameter_rrefs()]
    gap = max((p - q).abs().max().item() for p, q in zip(trained, reference.model.parameters(), strict=True))
    print(f"final test accuracy: pipelined {accuracy(model, test_images, test_labels):.2%}, "
          f"unsplit {accuracy(reference.model, test_images, test_labels):.2%}", flush=True)
    print(f"largest parameter difference from the unsplit model: {gap:.2e}", flush=True)


def resume(checkpoints: ModelParallelCheckpoint | None, model: PipelinedModel, optimizer: DistributedOptimizer,
           reference: Reference) -> int:
    """Put the shards, their optimizer state and the reference back as the latest checkpoint has them;
    the epoch to go on from."""
    latest = checkpoints.load_latest(model.shards(), optimizer) if checkpoints else None
    if latest is None:
        return 0
    reference.load_state_dict(latest.state)
    if latest.step > 0:
        print(f"resuming from {latest.path.name}: epoch {latest.step}", flush=True)
    return latest.step


def train_epochs(args: argparse.Namespace, epochs: range, model: PipelinedModel, optimizer: DistributedOptimizer,
                 reference: Reference, checkpoints: ModelParallelCheckpoint | None) -> None:
    (images, labels), (test_images, test_labels) = (data.tensors for data in digits())
    for epoch in epochs:
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
        total = 0.0
        for start in range(0, len(order), args.batch_size):
            x, y = images[order[start:start + args.batch_size]], labels[order[start:start + args.batch_size]]
            with dist_autograd.context() as context_id:
                loss = nn.functional.cross_entropy(model(x), y)
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
            total += loss.item() * len(y)
            reference.train_step(x, y)
        print(f"epoch {epoch}: loss {total / len(order):.4f}, test accuracy pipelined "
              f"{accuracy(model, test_images, test_labels):.2%}, unsplit "
              f"{accuracy(reference.model, test_images, test_labels):.2%}", flush=True)
        if checkpoints:
            checkpoints.save(epoch + 1, model.shards(), optimizer, extra=reference.state_dict())
    if checkpoints:
        checkpoints.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--checkpoint-dir", help="checkpoint every epoch here, and resume from the latest")
    parser.add_argument("--live", action="store_true",
                        help="with --checkpoint-dir: build a lost shard again on the other worker and go on")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # set by `shoal run`
    if world_size != 3:
        raise SystemExit(f"rpc_pipeline.py runs on 3 workers (a master and 2 shards), not {world_size}")
    rpc.init_rpc("master" if rank == 0 else f"shard{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        train(args)
    rpc.shutdown()
