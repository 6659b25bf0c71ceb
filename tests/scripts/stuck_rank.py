"""A job with one rank stuck outside communication: after three all-reduces, rank 1 stops calling
collectives, so rank 0's fourth times out (SHOAL_TIMEOUT_S). For `shoal trace hang`."""

import time

import torch

import shoal.distributed as dist

dist.init_process_group("shoal")
t = torch.ones(1000)
for _ in range(3):
    dist.all_reduce(t)
if dist.get_rank() == 1:
    time.sleep(600)  # the launcher stops us once rank 0 has failed
dist.all_reduce(t)
