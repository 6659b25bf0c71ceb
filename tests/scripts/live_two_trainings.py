"""Two live trainings in turn in one script, under `shoal run --live --max-restarts 1`: rank 2 kills
itself before the first training ends (in its first life), and the worker started in its place waits
until the others have closed that training (they touch the file named by --closed); the second training
has min_workers 3, so its members wait for that worker, which passes through the first training and
joins the second. Each training's members print what it trained ("training T samples ... generation G
of N steps S state D"), and the worker started again prints that it missed the first. Run it as a
module from the repository's root:

    shoal run --live --max-restarts 1 --nproc-per-node 3 -m tests.scripts.live_two_trainings --closed /tmp/x
"""

import argparse
import hashlib
import os
import signal
from pathlib import Path

import torch
from torch import nn

from shoal.data import ElasticSampler
from shoal.elastic import LiveTraining
from tests.waiting import wait_until

parser = argparse.ArgumentParser()
parser.add_argument("--closed", type=Path, required=True)
args = parser.parse_args()
rank = int(os.environ["RANK"])
first_life = os.environ.get("SHOAL_RESTART_COUNT", "0") == "0"
generator = torch.Generator().manual_seed(5)
x = torch.randn(61, 6, generator=generator, dtype=torch.float64)
data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long(), torch.arange(len(x)))
torch.manual_seed(0)
model = nn.Linear(6, 2).double()
if not first_life:
    wait_until(args.closed.exists, "the others have closed the first training", timeout=60)

for training, (epochs, min_workers) in enumerate([(1, 1), (2, 3)]):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = ElasticSampler(data, 2, rank=rank, world_size=int(os.environ["WORLD_SIZE"]), seed=training)
    live = LiveTraining(model, optimizer, sampler, min_workers=min_workers)
    if live.missed:
        print(f"training {training} missed", flush=True)
    trained = []
    for epoch in live.epochs(epochs):
        order = sampler.order()
        for inputs, labels, _ in live.batches(torch.utils.data.DataLoader(data, batch_sampler=sampler)):
            if first_life and rank == 2 and training == 0 and live.steps == 8:  # of 11 steps
                os.kill(os.getpid(), signal.SIGKILL)
            start = sampler.offset
            with live.step() as step:
                nn.functional.cross_entropy(live.model(inputs), labels).backward()
            if step.committed:
                trained += [(epoch, i) for i in order[start:sampler.offset]]
    if not live.missed:
        state = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
        print(f"training {training} samples {len(set(trained))} twice {len(trained) - len(set(trained))} "
              f"generation {live.generation.number} of {live.generation.size} steps {live.steps} state {state}",
              flush=True)
    live.close()
    if training == 0 and not live.missed:
        args.closed.touch()
