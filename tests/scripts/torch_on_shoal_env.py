"""A torch program on backend "shoal" from its launcher's environment (env://), as torchrun or `shoal run`
starts it: an all-reduce and a step of torch's DistributedDataParallel."""

import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel

import shoal  # noqa: F401 - registers backend "shoal"

tdist.init_process_group("shoal")
total = torch.tensor([float(tdist.get_rank() + 1)])
tdist.all_reduce(total)
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(4, 1))
model(torch.full((2, 4), float(tdist.get_rank()))).sum().backward()
print(f"backend {tdist.get_backend()} sum {total.item():g} grad {model.module.bias.grad.item():g}")
tdist.destroy_process_group()
