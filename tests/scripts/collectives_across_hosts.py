"""One rank of a job on two hosts: all-reduce a large tensor, all-gather into one of the same size, and
reduce-scatter one of the same size; check each result, and write to `result<rank>.json` the bytes our
host sent across each cable named during each (what every rank of our host sent across it).

The bytes are TCP's payload from our end of the cable, not counting TCP's own retransmissions: what shoal
wrote. The veth reorders packets now and then (its two ends' work lands on either vCPU), and TCP then resends
segments the other side already had, which a device's byte counter counts twice.

Usage: collectives_across_hosts.py RANK WORLD MASTER_ADDR MASTER_PORT DEVICE[,DEVICE...] NUMEL WORKDIR
"""

import json
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch

import shoal.distributed as dist
from shoal.comm.rendezvous import interface_address

rank, world, master, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
devices, numel, workdir = sys.argv[5].split(","), int(sys.argv[6]), Path(sys.argv[7])
addresses = {device: interface_address(device) for device in devices}
dist.init_process_group("shoal", f"tcp://{master}:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60))
dist.all_reduce(torch.ones(1))  # finds the hosts, which crosses the cable too


def sent_from(address: str) -> int:
    """Bytes TCP has sent from `address` to another host, over the connections open now, less those it sent
    again."""
    listing = subprocess.run(["ss", "-tinH", "src", address, "and", "not", "dst", address], check=True,
                             capture_output=True, text=True, timeout=30).stdout
    return sum(int(n) for n in re.findall(r"\bbytes_sent:(\d+)", listing)) - \
        sum(int(n) for n in re.findall(r"\bbytes_retrans:(\d+)", listing))


def sent_during(collective) -> dict[str, int]:
    # Read before the barrier: once it lets us go, our host's other rank may already be sending its part.
    before = {device: sent_from(address) for device, address in addresses.items()}
    dist.barrier()
    collective()
    dist.barrier()
    return {device: sent_from(address) - before[device] for device, address in addresses.items()}


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
