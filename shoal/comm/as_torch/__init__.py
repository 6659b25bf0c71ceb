"""shoal's groups as torch.distributed's: backend "shoal", which torch's own programs (its DDP, FSDP2,
DTensor, tensor parallelism, functional collectives) run on. `import shoal` registers it (world.py);
group.py answers torch's calls with shoal's collectives, and work.py hands back torch's Work."""

from shoal.comm.as_torch.group import TorchGroup
from shoal.comm.as_torch.work import TorchWork
from shoal.comm.as_torch.world import BACKEND, register

__all__ = ["BACKEND", "TorchGroup", "TorchWork", "register"]
