"""Rank 0 leaves a note in the job's rendezvous store and exits; rank 1 waits until rank 0's process is
gone, forms a group of its own through the same store, and finds the note: the store outlived rank 0
because the launcher serves it. Run it as a module from the repository's root, so that `tests` can be imported:

    shoal run --nproc-per-node 2 -m tests.scripts.regroup_after_rank0_leaves
"""

import os
from datetime import timedelta

import torch

import shoal.distributed as dist
from tests.waiting import process_gone, wait_until

timeout = timedelta(seconds=20)
dist.init_process_group("shoal", timeout=timeout)
pids = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
dist.all_gather(pids, torch.tensor([os.getpid()]))
if dist.get_rank() == 0:
    dist.default_group().store.raw.set("note from rank 0", b"hello")
dist.barrier()
dist.destroy_process_group()
if int(os.environ["RANK"]) == 1:
    wait_until(lambda: process_gone(int(pids[0].item())), "rank 0 has exited", timeout=timeout.total_seconds(),
               interval=0.05)
    dist.init_process_group("shoal", rank=0, world_size=1, timeout=timeout)  # env://: the same store
    t = torch.tensor([2.0])
    dist.all_reduce(t)
    note = dist.default_group().store.raw.get("note from rank 0").decode()
    print(f"regrouped alone after rank 0 left: sum {t.item():g}, note {note!r}")
    dist.destroy_process_group()
