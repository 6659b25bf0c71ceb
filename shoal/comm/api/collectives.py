"""Tensor collectives over a group (the default one unless `group=` names another). Ranks in
`src`/`dst` arguments are global ranks, even with a subgroup, as in torch."""

from __future__ import annotations

import torch

from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.api.world import _group
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.backends.work import Work


def _finish(work: Work, async_op: bool) -> Work | None:
    if async_op:
        return work
    work.wait()
    return None


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    return _finish(_group(group).all_reduce(tensor, op, async_op=async_op), async_op)


def all_reduce_coalesced(tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
                         async_op: bool = False) -> Work | None:
    return _finish(_group(group).all_reduce_coalesced(tensors, op, async_op=async_op), async_op)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None,
              async_op: bool = False) -> Work | None:
    return _finish(_group(group).broadcast(tensor, src, async_op=async_op), async_op)


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
           async_op: bool = False) -> Work | None:
    return _finish(_group(group).reduce(tensor, dst, op, async_op=async_op), async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    return _finish(_group(group).all_gather(tensor_list, tensor, async_op=async_op), async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    return _finish(_group(group).gather(tensor, gather_list, dst, async_op=async_op), async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    return _finish(_group(group).scatter(tensor, scatter_list, src, async_op=async_op), async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                   group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    return _finish(_group(group).reduce_scatter(output, input_list, op, async_op=async_op), async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    return _finish(_group(group).all_to_all(output_tensor_list, input_tensor_list, async_op=async_op), async_op)


def barrier(group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    return _finish(_group(group).barrier(async_op=async_op), async_op)
