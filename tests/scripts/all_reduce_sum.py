"""Every rank all-reduces its rank + 1 and prints the sum."""

import torch

import shoal.distributed as dist

dist.init_process_group("shoal")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"sum {t.item():g} of world {dist.get_world_size()}")
dist.destroy_process_group()
