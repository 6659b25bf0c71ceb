"""A parameter-server program written the usual way: the parent runs a parallel torch op, then forks
its workers with shoal.multiprocessing.Process (fork, torch's default threads); each calls init_rpc,
and the trainer trains with distributed autograd and a DistributedOptimizer. The rounds run one after
another from the same parent; each prints "round N: losses L1 L2 ..." once both workers have exited 0
within the deadline, or "round N: failed (exit codes ...)" and ends the program with status 1.

    python -m tests.scripts.fork_parameter_server --rounds 10
"""

import argparse
import faulthandler
import os
import sys

import torch
from torch import nn

import shoal.multiprocessing as mp
from shoal import autograd as dist_autograd
from shoal import rpc
from shoal.optim import DistributedOptimizer
from shoal.ports import free_port

ROWS, WIDTH, OUT, BATCH, STEPS, LR = 200_000, 32, 8, 64, 3, 0.01
DEADLINE_S = 60


class Server:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.layer = nn.Linear(WIDTH, OUT)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layer(features)

    def parameters(self) -> list[rpc.RRef]:
        return [rpc.RRef(p) for p in self.layer.parameters()]


def trainer_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, ROWS, (BATCH,), generator=generator) for _ in range(STEPS)]


def embedding() -> nn.Embedding:
    """A small forward and a large backward: the dense gradient of 200,000 rows, made in the trainer's
    own pass, and stepped by its own optimizer: parallel ops that hang on a forked process's main thread."""
    torch.manual_seed(1)
    return nn.Embedding(ROWS, WIDTH)


def worker(rank: int, port: int, losses: "mp.Queue") -> None:
    faulthandler.dump_traceback_later(DEADLINE_S - 5, exit=True)  # a hang shows where it is
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 1:
        server, local = rpc.remote("worker0", Server), embedding()
        params = server.rpc_sync().parameters() + [rpc.RRef(p) for p in local.parameters()]
        optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=LR)
        seen = []
        for indices in trainer_batches():
            with dist_autograd.context() as context:
                features = local(indices)
                loss = server.rpc_sync().forward(features).sum() + features.sum()
                dist_autograd.backward(context, [loss])
                optimizer.step(context)
            seen.append(loss.item())
        losses.put(seen)
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    for round_ in range(args.rounds):
        torch.relu(torch.randn(2000, 2000)).sum()  # a parallel op in the parent, before the fork
        port, losses = free_port(), mp.Queue()
        workers = [mp.Process(target=worker, args=(rank, port, losses)) for rank in range(2)]
        for process in workers:
            process.start()
        for process in workers:
            process.join(DEADLINE_S)
        codes = [process.exitcode for process in workers]
        for process in workers:
            if process.is_alive():
                process.kill()
                process.join()
        if codes != [0, 0]:
            print(f"round {round_}: failed (exit codes {codes})", flush=True)
            sys.exit(1)
        print(f"round {round_}: losses {' '.join(repr(loss) for loss in losses.get(timeout=5))}", flush=True)


if __name__ == "__main__":
    main()
