"""Modules for model-parallel training over RPC, and collectives that autograd differentiates through
(torch.distributed.nn's names)."""

from torch.autograd import Function

from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.api.world import group
from shoal.nn.functional import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_single,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
from shoal.nn.remote_module import RemoteModule

__all__ = [
    "Function",
    "ReduceOp",
    "RemoteModule",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "gather",
    "group",
    "reduce",
    "reduce_scatter",
    "scatter",
]
