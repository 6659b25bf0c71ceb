"""One rank of a job on two hosts: all-reduce a large tensor, all-gather into one of the same size, and
reduce-scatter one of the same size; check each result, and write to `result<rank>.json` the bytes our
host's end of each cable named sent during each (what every rank of our host sent across it).

Usage: collectives_across_hosts.py RANK WORLD MASTER_ADDR MASTER_PORT DEVICE[,DEVICE...] NUMEL WORKDIR
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch

import shoal.distributed as dist

rank, world, master, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
devices, numel, workdir = sys.argv[5].split(","), int(sys.argv[6]), Path(sys.argv[7])
counters = {device: Path(f"/sys/class/net/{device}/statistics/tx_bytes") for device in devices}  # this namespace's
dist.init_process_group("shoal", f"tcp://{master}:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60))
dist.all_reduce(torch.ones(1))  # finds the hosts, which crosses the cable too


def sent_during(collective) -> dict[str, int]:
    # Read before the barrier: once it lets us go, our host's other rank may already be sending its part.
    before = {device: int(counter.read_text()) for device, counter in counters.items()}
    dist.barrier()
    collective()
    dist.barrier()
    return {device: int(counter.read_text()) - before[device] for device, counter in counters.items()}


tensor = torch.full((numel,), float(rank + 1))
reduced = sent_during(lambda: dist.all_reduce(tensor))
blocks = [torch.empty(numel // world) for _ in range(world)]
gathered = sent_during(lambda: dist.all_gather(blocks, torch.full((numel // world,), float(rank))))
out = torch.empty(numel // world)
inputs = [torch.full((numel // world,), float((rank + 1) * (d + 1))) for d in range(world)]
scattered = sent_during(lambda: dist.reduce_scatter(out, inputs))
right = {"all_reduce": bool((tensor == world * (world + 1) / 2).all()),
         "all_gather": all(bool((block == r).all()) for r, block in enumerate(blocks)),
         "reduce_scatter": bool((out == (rank + 1) * world * (world + 1) / 2).all())}
hosts = dist.default_group().hosts
dist.destroy_process_group()
(workdir / f"result{rank}.json").write_text(json.dumps({"sent": {"all_reduce": reduced, "all_gather": gathered,
                                                                 "reduce_scatter": scattered},
                                                        "right": right, "hosts": hosts}))
