"""Process groups: the API every backend offers (`ProcessGroup`, group.py) and its `Work` handles (work.py);
the "shoal" backend over our own transport and algorithms (native.py); "gloo" and "nccl", delegated to
torch.distributed (c10d.py); the backends by name, and a world group of each built from a joined store
(registry.py)."""

from shoal.comm.backends.c10d import C10dProcessGroup
from shoal.comm.backends.group import DEFAULT_TIMEOUT, ProcessGroup
from shoal.comm.backends.native import ShoalProcessGroup
from shoal.comm.backends.registry import BACKENDS, check_backend, world_group
from shoal.comm.backends.work import Work

__all__ = ["BACKENDS", "DEFAULT_TIMEOUT", "C10dProcessGroup", "ProcessGroup", "ShoalProcessGroup", "Work",
           "check_backend", "world_group"]
