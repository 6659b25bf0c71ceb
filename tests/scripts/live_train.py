"""Live recovery under `shoal run --live`: a small classifier trained for some epochs; each --kill
RANK:STEP makes that rank SIGKILL itself before that step (in its first life only: a worker the
launcher starts in its place joins and goes on); each --kill-launcher RANK:STEP makes it SIGKILL its
launcher instead, which takes the worker with it (a lost node). Whenever its generation changes,
each worker prints the step and a digest of its parameters, optimizer state and learning-rate
schedule (under --diloco or --post-local-sgd, the state the replicas share: not their own momenta);
after each step made final (a period's last, under those), each member prints the samples it trained
since the one before ("trained EPOCH I J ...") and, under those, the step count and state it made final
("final STEP state DIGEST"); each that finishes prints what its ledger of committed
steps says, and its scheduler's count.
The loop is the one docs/training.md gives. Run it as a module from
the repository's root, so that `tests` can be imported:

    shoal run --live --max-restarts 1 --nproc-per-node 3 -m tests.scripts.live_train --kill 1:5
"""

import argparse
import hashlib
import os
import signal
import time

import torch
from torch import nn

from shoal.comm.objects import all_gather_object
from shoal.data import ElasticSampler
from shoal.elastic import LiveTraining
from shoal.optim import DiLoCoOptimizer, PostLocalSGDOptimizer
from shoal.parallel import PeriodicModelAverager, PowerSGDState, fully_shard, powerSGD_hook
from tests.waiting import wait_until

parser = argparse.ArgumentParser()
parser.add_argument("--kill", action="append", default=[], help="RANK:STEP")
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--kill-launcher", action="append", default=[], help="RANK:STEP")
parser.add_argument("--min-workers", type=int, default=None)
parser.add_argument("--await-joiner", action="store_true",
                    help="short-handed members pause between steps until a worker asks to join, until one has")
parser.add_argument("--full-size", type=int, default=None,
                    help="with --await-joiner: the workers of a whole generation (WORLD_SIZE by default)")
parser.add_argument("--powersgd", action="store_true", help="DDP sends the gradients compressed by PowerSGD")
parser.add_argument("--shard", action="store_true", help="fully_shard the model (its 2 rows: blocks of 1, 1 and 0)")
parser.add_argument("--diloco", action="store_true", help="DiLoCo, synchronizing every 3 steps")
parser.add_argument("--post-local-sgd", action="store_true", help="post-local SGD, averaging every 3 steps")
args = parser.parse_args()
kills = {tuple(map(int, k.split(":"))) for k in args.kill}
launcher_kills = {tuple(map(int, k.split(":"))) for k in args.kill_launcher}
rank = int(os.environ["RANK"])
first_life = os.environ.get("SHOAL_RESTART_COUNT", "0") == "0"

generator = torch.Generator().manual_seed(5)
x = torch.randn(61, 6, generator=generator, dtype=torch.float64)
data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long(), torch.arange(len(x)))  # each sample's index too
torch.manual_seed(0)
model = nn.Linear(6, 2).double()
if args.shard:
    fully_shard(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
trainer: torch.optim.Optimizer = optimizer  # what LiveTraining steps
if args.diloco:
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    trainer = DiLoCoOptimizer(optimizer, outer, sync_every=3)
if args.post_local_sgd:
    trainer = PostLocalSGDOptimizer(optimizer, PeriodicModelAverager(period=3))
periodic = trainer is not optimizer  # the replicas' own momenta differ between synchronizations
sampler = ElasticSampler(data, 2, rank=rank, world_size=int(os.environ["WORLD_SIZE"]), seed=1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)  # stepped once per committed step
extra = {"scheduler": scheduler}
if args.powersgd:  # the 2 x 6 weight as two factors (not worth it at the default min_compression_rate of 2)
    extra["powersgd"] = PowerSGDState(None, start_powerSGD_iter=2, min_compression_rate=1)
live = LiveTraining(model, trainer, sampler, extra=extra, min_workers=args.min_workers)
if args.powersgd:
    live.model.register_comm_hook(extra["powersgd"], powerSGD_hook)


def digest() -> str:
    momenta = [] if periodic else [optimizer.state[p]["momentum_buffer"] for p in model.parameters()
                                   if p in optimizer.state]
    if args.diloco:
        momenta = [outer.state[p]["momentum_buffer"] for p in model.parameters() if p in outer.state]
    tensors = [*model.parameters(), *momenta]
    if args.shard:  # every member's rows, gathered (a collective: the members report at the same step)
        tensors = [*model.state_dict().values(), *(t for rows in all_gather_object_list(momenta) for t in rows)]
    schedule = f"{scheduler.last_epoch} {optimizer.param_groups[0]['lr']!r}".encode()
    if args.powersgd:  # what the replicas must hold alike to project alike: the factors and the generator
        state = extra["powersgd"]
        tensors += [*state.p_memory_dict.values(), *state.q_memory_dict.values()]
        _, keys, position, *_ = state.rng.get_state()
        schedule += keys.tobytes() + f" {position} {state.iter}".encode()
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in tensors) + schedule).hexdigest()[:16]


def all_gather_object_list(obj: object) -> list:
    gathered = [None] * live.group.size
    all_gather_object(live.group, gathered, obj)
    return gathered


def report() -> int:
    print(f"generation {live.generation.number} of {live.generation.size} step {live.steps} state {digest()}",
          flush=True)
    return live.generation.number


reported, size = report(), live.generation.size
full_size = args.full_size or int(os.environ["WORLD_SIZE"])
grown = False  # a generation has admitted a joiner: --await-joiner waits no more
trained: list[tuple[int, int]] = []
taken: list[int] = []  # this member's samples since the last step made final
for epoch in live.epochs(args.epochs):
    order = sampler.order()
    for inputs, labels, indices in live.batches(torch.utils.data.DataLoader(data, batch_sampler=sampler)):
        if live.generation.number != reported:
            reported, grown, size = report(), grown or live.generation.size > size, live.generation.size
        if args.await_joiner and not grown and live.generation.size < full_size:
            wait_until(lambda: live.membership.joiners_waiting(live.generation), "a worker asks to join",
                       timeout=60)
            time.sleep(0.25)  # longer than LiveTraining's 0.2 s between looks for joiners: the next decision looks
        if first_life and (rank, live.steps) in kills:
            os.kill(os.getpid(), signal.SIGKILL)
        if (rank, live.steps) in launcher_kills:
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(60)  # the kernel kills this worker with its launcher (shoal.orphans)
        start = sampler.offset
        with live.step() as step:
            nn.functional.cross_entropy(live.model(inputs), labels).backward()
        taken = taken + indices.tolist() if step.committed else []
        if step.committed:
            scheduler.step()
        if step.synchronized:
            print(f"trained {epoch} {' '.join(map(str, taken))}", flush=True)
            trained += [(epoch, i) for i in order[start:sampler.offset]]  # every member's share
            taken = []
            if periodic:
                print(f"final {live.steps} state {digest()}", flush=True)
once = len(set(trained))
counted = ""  # the steps a periodic optimizer counted itself, undone with a period as LiveTraining's are
if args.diloco:
    counted = f" counted {trainer.local_steps}"
if args.post_local_sgd:
    counted = f" counted {trainer.averager.step}"
print(f"samples {once} missing {args.epochs * len(data) - once} twice {len(trained) - once} "
      f"generation {live.generation.number} of {live.generation.size} steps {live.steps}{counted} state {digest()} "
      f"scheduler {scheduler.last_epoch}")
live.close()
