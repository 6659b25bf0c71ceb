"""Live recovery under `shoal run --live`: a small classifier trained for one epoch; the rank and step
given by --kill RANK:STEP SIGKILL themselves. Each worker that finishes prints what its ledger of
committed steps says, and a digest of its parameters."""

import argparse
import hashlib
import os
import signal

import torch
from torch import nn

from shoal.data import ElasticSampler
from shoal.elastic import LiveTraining

parser = argparse.ArgumentParser()
parser.add_argument("--kill", default="-1:-1")
victim, lost_at = map(int, parser.parse_args().kill.split(":"))
rank = int(os.environ["RANK"])

generator = torch.Generator().manual_seed(5)
x = torch.randn(61, 6, generator=generator, dtype=torch.float64)
data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
torch.manual_seed(0)
model = nn.Linear(6, 2).double()
sampler = ElasticSampler(data, 2, rank=rank, world_size=int(os.environ["WORLD_SIZE"]), seed=1)
live = LiveTraining(model, torch.optim.SGD(model.parameters(), lr=0.1), sampler)
trained: list[int] = []
order = sampler.order()
for inputs, labels in live.batches(torch.utils.data.DataLoader(data, batch_sampler=sampler)):
    if rank == victim and live.steps == lost_at:
        os.kill(os.getpid(), signal.SIGKILL)
    start = sampler.offset
    with live.step():
        nn.functional.cross_entropy(live.model(inputs), labels).backward()
    trained += order[start:sampler.offset]  # what the step committed, every member's share
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
print(f"samples {len(set(trained))} missing {len(data) - len(set(trained))} twice {len(trained) - len(set(trained))} "
      f"generation {live.generation.number} of {live.generation.size} params {digest}")
live.close()
