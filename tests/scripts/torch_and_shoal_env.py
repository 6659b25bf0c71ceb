"""A script that initializes torch.distributed and shoal side by side, both from the launcher's
environment (env://): both meet in the one store that the launcher serves."""

import torch
import torch.distributed as tdist

import shoal.distributed as dist

tdist.init_process_group("gloo")
dist.init_process_group("gloo")
theirs, ours = torch.tensor([1.0]), torch.tensor([10.0])
tdist.all_reduce(theirs)
dist.all_reduce(ours)
print(f"torch {theirs.item():g} shoal {ours.item():g}")
dist.destroy_process_group()
tdist.destroy_process_group()
