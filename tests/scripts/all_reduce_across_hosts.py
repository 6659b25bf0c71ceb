"""One rank of a job on two hosts: all-reduce a large tensor once, check the result, and write to
`result<rank>.json` the bytes our host's end of the cable sent meanwhile (the other ranks of our host
send across it only through us, its leader).

Usage: all_reduce_across_hosts.py RANK WORLD MASTER_ADDR MASTER_PORT DEVICE NUMEL WORKDIR
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch

import shoal.distributed as dist

rank, world, master, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
device, numel, workdir = sys.argv[5], int(sys.argv[6]), Path(sys.argv[7])
sent = Path(f"/sys/class/net/{device}/statistics/tx_bytes")  # this namespace's view of sysfs
dist.init_process_group("shoal", f"tcp://{master}:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60))
dist.all_reduce(torch.ones(1))  # finds the hosts, which crosses the cable too
dist.barrier()
before = int(sent.read_text())
tensor = torch.full((numel,), float(rank + 1))
dist.all_reduce(tensor)
dist.barrier()
after = int(sent.read_text())
right = bool((tensor == world * (world + 1) / 2).all())
hosts = dist.default_group().hosts
dist.destroy_process_group()
(workdir / f"result{rank}.json").write_text(json.dumps({"sent": after - before, "right": right, "hosts": hosts}))
