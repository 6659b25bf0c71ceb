"""torch.distributed's public functions and names over shoal's process groups (`import shoal.distributed
as dist`), one family per module."""

from shoal.comm.api.collectives import (
    all_gather,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
from shoal.comm.api.groups import new_group
from shoal.comm.api.object_collectives import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    scatter_object_list,
)
from shoal.comm.api.point_to_point import irecv, isend, recv, send
from shoal.comm.api.world import (
    default_group,
    destroy_process_group,
    get_backend,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
)

__all__ = [
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "default_group",
    "destroy_process_group",
    "gather",
    "gather_object",
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
    "scatter_object_list",
    "send",
]
