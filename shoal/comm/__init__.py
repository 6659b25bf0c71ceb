"""shoal's communication library: process groups, collectives and point-to-point over our own
transport (backend "shoal") or torch.distributed (backends "gloo" and "nccl")."""

from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.api import (
    all_gather,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    barrier,
    broadcast,
    default_group,
    destroy_process_group,
    gather,
    get_backend,
    get_rank,
    get_world_size,
    init_process_group,
    irecv,
    is_initialized,
    isend,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    scatter,
    send,
)
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.backends.work import Work

__all__ = [
    "ProcessGroup",
    "ReduceOp",
    "Work",
    "all_gather",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "barrier",
    "broadcast",
    "default_group",
    "destroy_process_group",
    "gather",
    "get_backend",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "irecv",
    "is_initialized",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
]
