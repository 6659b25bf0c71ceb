"""The pipeline job `benchmarks/rpc_recovery.py` kills a stage of: a driver (rank 0) trains the MLP of
`examples/parameter_server.py` with a 128-wide middle layer added, cut into three RemoteModule stages
(ranks 1-3: its first layer, the middle layer, the last layer), on the digits with
distributed autograd and a DistributedOptimizer (SGD with momentum), under `shoal run --live`.

`--source replica`: through `LiveModules(replica=True)`; `--source checkpoint`: through LiveModules
with a checkpoint every `--every` steps in `--checkpoint-dir`; `--source none`: the plain loop, no
LiveModules (the baseline of the replica's cost). Rank 2, the middle stage's worker, prints `death T`
and SIGKILLs itself in its forward of step `--kill-at`; the driver prints `applied S T` once step S
is committed.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from torch import nn

from shoal import autograd as dist_autograd
from shoal import rpc
from shoal.checkpoint import ModelParallelCheckpoint
from shoal.demo import digits
from shoal.elastic import LiveModules
from shoal.nn import RemoteModule
from shoal.optim import DistributedOptimizer

BATCH = 32
CUTS = [(0, 3), (3, 5), (5, 6)]  # the layers of each stage
_forwards = [0]  # on rank 2: the forwards its stage has run


class Stage(nn.Module):
    """Layers [start, stop) of the model; on rank 2, the process dies in its forward of step `kill_at`."""

    def __init__(self, start: int, stop: int, kill_at: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                    nn.Linear(128, 10))[start:stop]
        self.kill_at = kill_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if int(os.environ["RANK"]) == 2:
            if _forwards[0] == self.kill_at:
                print(f"death {time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            _forwards[0] += 1
        return self.layers(x)


def drive(args: argparse.Namespace) -> None:
    images, labels = digits()[0].tensors
    stages = {f"stage{index + 1}": RemoteModule(f"w{index + 1}/cpu", Stage, args=(*cut, args.kill_at))
              for index, cut in enumerate(CUTS)}

    def train_step(context_id: int, step: int) -> None:
        batch = torch.randperm(len(labels), generator=torch.Generator().manual_seed(step))[:BATCH]
        x = images[batch]
        for stage in stages.values():
            x = stage(x)
        dist_autograd.backward(context_id, [nn.functional.cross_entropy(x, labels[batch])])

    def sgd(params: list[rpc.RRef]) -> DistributedOptimizer:
        return DistributedOptimizer(torch.optim.SGD, params, lr=0.05, momentum=0.9)

    if args.source == "none":
        optimizer = sgd([param for stage in stages.values() for param in stage.remote_parameters()])
        for step in range(args.steps):
            with dist_autograd.context() as context_id:
                train_step(context_id, step)
                optimizer.step(context_id)
            print(f"applied {step} {time.time():.6f}", flush=True)
        return
    checkpoints = ModelParallelCheckpoint(args.checkpoint_dir) if args.source == "checkpoint" else None
    live = LiveModules(stages, sgd, replica=args.source == "replica", checkpoints=checkpoints, every=args.every)
    while live.step < args.steps:
        live.run(train_step)
        print(f"applied {live.step - 1} {time.time():.6f}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--source", choices=["replica", "checkpoint", "none"], default="replica")
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--every", type=int, default=5)
    args = parser.parse_args()
    if args.source == "checkpoint" and not args.checkpoint_dir:
        parser.error("--source checkpoint needs --checkpoint-dir")
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    if rank == 0:
        drive(args)
    rpc.shutdown()
