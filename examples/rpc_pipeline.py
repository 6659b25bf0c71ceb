"""A model pipelined over RPC on the digits: an MLP cut into shards that live on the other workers
(two or three: one per worker beside the master), as RemoteModules driven by a master that splits
each batch into micro-batches, so that each shard works on one micro-batch while the next shard
works on the one before. Distributed autograd carries the gradients back through every shard and a
DistributedOptimizer updates them. The master also trains the unsplit model on the same batches:
the micro-batches' gradients add up to the whole batch's, so both end with the same weights.

With --checkpoint-dir, the master checkpoints the shards, the optimizer's state on their workers
and its own reference model after every epoch, and resumes from the latest checkpoint when it
starts: under `shoal run --max-restarts 1`, a job that lost any of its workers starts again and
goes on from the last epoch it finished. With --live, under `shoal run --live`, nothing is
restarted (`shoal.elastic.LiveModules`): the master keeps a replica of every shard and its
momentum after each step, and when a shard's worker dies, builds that shard again on another, puts
every shard and its own model back as the replica has them, and redoes the step it was in; nothing
learned is lost (the master itself must live).

    shoal run --nproc-per-node 3 examples/rpc_pipeline.py                 # master + 2 shards
    shoal run --nproc-per-node 4 examples/rpc_pipeline.py --microbatches 8   # master + 3 shards
    shoal run --nproc-per-node 3 --max-restarts 1 examples/rpc_pipeline.py --checkpoint-dir ckpt
    shoal run --live --nproc-per-node 4 examples/rpc_pipeline.py --live
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
from torch import nn

from shoal import autograd as dist_autograd
from shoal import rpc
from shoal.checkpoint import ModelParallelCheckpoint
from shoal.demo import digits
from shoal.elastic import LiveModules
from shoal.nn import RemoteModule
from shoal.optim import DistributedOptimizer

CUTS = {2: [(0, 4), (4, 6)], 3: [(0, 2), (2, 4), (4, 6)]}  # the layers of each shard, by the number of shards
KEYS = ["first", "second", "third"]


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


class PipelinedModel(nn.Module):
    """Each micro-batch goes to the first shard, whose output stays there (an RRef) and is fetched by
    the next; calls are asynchronous, so micro-batches overlap across the shards. The shards are
    RemoteModules, so a LiveModules that builds one again elsewhere re-binds it here too."""

    def __init__(self, shards: int, microbatches: int) -> None:
        super().__init__()
        self.microbatches = microbatches
        self.shards = {KEYS[index]: RemoteModule(f"shard{index + 1}/cpu", Shard, args=cut)
                       for index, cut in enumerate(CUTS[shards])}

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        *middle, last = self.shards.values()
        outputs = []
        for chunk in images.chunk(self.microbatches):
            hidden = rpc.RRef(chunk)
            for shard in middle:
                hidden = shard.get_module_rref().remote().forward(hidden)
            outputs.append(last.get_module_rref().rpc_async().forward(hidden))
        return torch.cat(torch.futures.wait_all(outputs))

    def parameter_rrefs(self) -> list[rpc.RRef]:
        return [rref for shard in self.shards.values() for rref in shard.remote_parameters()]


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


class Training:
    """Steps numbered through the epochs: step s trains on batch s % steps_per_epoch of epoch
    s // steps_per_epoch, so a step run again trains on the same batch."""

    def __init__(self, args: argparse.Namespace, model: PipelinedModel, reference: Reference) -> None:
        self.args, self.model, self.reference = args, model, reference
        (self.images, self.labels), (self.test_images, self.test_labels) = (data.tensors for data in digits())
        self.steps_per_epoch = -(-len(self.labels) // args.batch_size)
        self.losses: dict[int, float] = {}  # this epoch's, by step (a step run again replaces its loss)
        self.use = lambda fn, *args: fn(*args)  # how the shards are used outside a step: LiveModules.call, live

    def step(self, context_id: int, step: int) -> None:
        """The forward and backward of step `step` of both models (the DistributedOptimizer steps next)."""
        epoch, part = divmod(step, self.steps_per_epoch)
        order = torch.randperm(len(self.labels), generator=torch.Generator().manual_seed(epoch))
        batch = order[part * self.args.batch_size:(part + 1) * self.args.batch_size]
        x, y = self.images[batch], self.labels[batch]
        loss = nn.functional.cross_entropy(self.model(x), y)
        dist_autograd.backward(context_id, [loss])
        self.reference.train_step(x, y)
        self.losses[step] = loss.item() * len(y)

    def end_of_epoch(self, step: int) -> None:
        """Print the epoch that step `step` (the number of steps done) ended, if it ended one."""
        epoch, part = divmod(step, self.steps_per_epoch)
        if part != 0:
            return
        total = sum(loss for done, loss in self.losses.items() if done // self.steps_per_epoch == epoch - 1)
        print(f"epoch {epoch - 1}: loss {total / len(self.labels):.4f}, test accuracy pipelined "
              f"{self.use(accuracy, self.model, self.test_images, self.test_labels):.2%}, unsplit "
              f"{accuracy(self.reference.model, self.test_images, self.test_labels):.2%}", flush=True)
        self.losses = {done: loss for done, loss in self.losses.items() if done >= step}


def train(args: argparse.Namespace, shards: int) -> None:
    model, reference = PipelinedModel(shards, args.microbatches), Reference(args.lr)
    training = Training(args, model, reference)
    total, every = args.epochs * training.steps_per_epoch, training.steps_per_epoch
    checkpoints = ModelParallelCheckpoint(args.checkpoint_dir, async_save=True) if args.checkpoint_dir else None
    if args.live:
        live = LiveModules(model.shards, make_optimizer(args), replica=True, checkpoints=checkpoints, every=every,
                           extra={"reference": reference})
        training.use = live.call
        resumed(live.step, training)
        while live.step < total:
            reported = len(live.recoveries)
            live.run(training.step)
            training.end_of_epoch(live.step)
            for recovery in live.recoveries[reported:]:
                print(f"lost {recovery.lost}: shard(s) {sorted(recovery.moved)} built again on "
                      f"{sorted(set(recovery.moved.values()))}; every shard restored from {recovery.source}, "
                      f"step {recovery.step}", flush=True)
    else:
        optimizer = make_optimizer(args)(model.parameter_rrefs())
        latest = checkpoints.load_latest(model.shards, optimizer) if checkpoints else None
        if latest is not None:
            reference.load_state_dict(latest.state["reference"])
        for step in range(resumed(latest.step if latest else 0, training), total):
            with dist_autograd.context() as context_id:
                training.step(context_id, step)
                optimizer.step(context_id)
            if checkpoints and (step + 1) % every == 0:
                checkpoints.save(step + 1, model.shards, optimizer, extra={"reference": reference.state_dict()})
            training.end_of_epoch(step + 1)
    if checkpoints:
        checkpoints.wait()
    trained = training.use(lambda: [rref.to_here() for rref in model.parameter_rrefs()])
    gap = max((p - q).abs().max().item() for p, q in zip(trained, reference.model.parameters(), strict=True))
    print(f"final test accuracy: pipelined "
          f"{training.use(accuracy, model, training.test_images, training.test_labels):.2%}, "
          f"unsplit {accuracy(reference.model, training.test_images, training.test_labels):.2%}", flush=True)
    print(f"largest parameter difference from the unsplit model: {gap:.2e}", flush=True)


def resumed(step: int, training: Training) -> int:
    """`step`, the step a job goes on from, said when it is not the first."""
    if step > 0:
        print(f"resuming from step {step}: epoch {step // training.steps_per_epoch}", flush=True)
    return step


def make_optimizer(args: argparse.Namespace) -> Callable[[list[rpc.RRef]], DistributedOptimizer]:
    return lambda params: DistributedOptimizer(torch.optim.SGD, params, lr=args.lr, momentum=0.9)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--checkpoint-dir", help="checkpoint every epoch here, and resume from the latest")
    parser.add_argument("--live", action="store_true",
                        help="keep a replica of the shards; build a lost shard again on another worker and go on")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # set by `shoal run`
    if world_size - 1 not in CUTS:
        raise SystemExit(f"rpc_pipeline.py runs on 3 or 4 workers (a master and 2 or 3 shards), not {world_size}")
    rpc.init_rpc("master" if rank == 0 else f"shard{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        train(args, world_size - 1)
    rpc.shutdown()
