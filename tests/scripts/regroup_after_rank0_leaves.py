"""Rank 0 leaves the job right after one all-reduce; rank 1 waits until rank 0's process is gone and
then forms a group of its own through the job's rendezvous store, which the launcher serves."""

import os
import time
from datetime import timedelta

import torch

import shoal.distributed as dist


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


timeout = timedelta(seconds=20)
dist.init_process_group("shoal", timeout=timeout)
pids = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
dist.all_gather(pids, torch.tensor([os.getpid()]))
dist.destroy_process_group()
if int(os.environ["RANK"]) == 1:
    while not gone(int(pids[0].item())):  # the launcher reaps it
        time.sleep(0.05)
    dist.init_process_group("shoal", rank=0, world_size=1, timeout=timeout)  # env://: the same store
    t = torch.tensor([2.0])
    dist.all_reduce(t)
    print(f"regrouped alone after rank 0 left: sum {t.item():g}")
    dist.destroy_process_group()
