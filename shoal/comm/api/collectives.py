"""Tensor collectives over a group (the default one unless `group=` names another). Roots are global
ranks (`src`, `dst`) or the group's own (`group_src`, `group_dst`), as in torch. A rank outside the
group (given GroupMember.NON_GROUP_MEMBER) warns and does nothing."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from datetime import timedelta

import torch

from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.api.world import _group, default_group, members_only, root
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.backends.work import Work


def _finish(work: Work, async_op: bool) -> Work | None:
    if async_op:
        return work
    work.wait()
    return None


@members_only()
def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    return _finish(_group(group).all_reduce(tensor, op, async_op=async_op), async_op)


@members_only()
def all_reduce_coalesced(tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
                         async_op: bool = False) -> Work | None:
    return _finish(_group(group).all_reduce_coalesced(tensors, op, async_op=async_op), async_op)


@members_only()
def broadcast(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, async_op: bool = False,
              group_src: int | None = None) -> Work | None:
    group = _group(group)
    return _finish(group.broadcast(tensor, root(group, src, group_src, "src"), async_op=async_op), async_op)


@members_only()
def reduce(tensor: torch.Tensor, dst: int | None = None, op: ReduceOp = ReduceOp.SUM,
           group: ProcessGroup | None = None, async_op: bool = False, group_dst: int | None = None) -> Work | None:
    group = _group(group)
    return _finish(group.reduce(tensor, root(group, dst, group_dst, "dst"), op, async_op=async_op), async_op)


@members_only()
def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    return _finish(_group(group).all_gather(tensor_list, tensor, async_op=async_op), async_op)


@members_only()
def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup | None = None,
                           async_op: bool = False) -> Work | None:
    """Every rank's `input_tensor`, in rank order, in one tensor: `output_tensor` holds world-size times as
    many elements (stacked or concatenated: any contiguous shape of that size)."""
    return _finish(_group(group).all_gather_into_tensor(output_tensor, input_tensor, async_op=async_op), async_op)


all_gather_single = all_gather_into_tensor  # torch 2.13's new name for it (torch still takes the old one)


@members_only()
def all_gather_coalesced(output_tensor_lists: list[list[torch.Tensor]], input_tensor_list: list[torch.Tensor],
                         group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """all_gather of several tensors at once: `output_tensor_lists[r][i]` receives rank r's
    `input_tensor_list[i]`."""
    return _finish(_group(group).all_gather_coalesced(output_tensor_lists, input_tensor_list), async_op)


@members_only()
def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int | None = None,
           group: ProcessGroup | None = None, async_op: bool = False, group_dst: int | None = None) -> Work | None:
    group = _group(group)
    dst = root(group, dst, group_dst, "dst", default=0)
    return _finish(group.gather(tensor, gather_list, dst, async_op=async_op), async_op)


@members_only()
def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int | None = None,
            group: ProcessGroup | None = None, async_op: bool = False, group_src: int | None = None) -> Work | None:
    group = _group(group)
    src = root(group, src, group_src, "src", default=0)
    return _finish(group.scatter(tensor, scatter_list, src, async_op=async_op), async_op)


@members_only()
def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                   group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    return _finish(_group(group).reduce_scatter(output, input_list, op, async_op=async_op), async_op)


@members_only()
def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                          group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """reduce_scatter of one tensor cut into world-size equal parts: this rank's `output` gets its part,
    reduced over the ranks."""
    return _finish(_group(group).reduce_scatter_tensor(output, input, op, async_op=async_op), async_op)


reduce_scatter_single = reduce_scatter_tensor  # torch 2.13's new name for it (torch still takes the old one)


@members_only()
def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    return _finish(_group(group).all_to_all(output_tensor_list, input_tensor_list, async_op=async_op), async_op)


@members_only()
def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Sequence[int] | None = None, input_split_sizes: Sequence[int] | None = None,
                      group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """all_to_all of two tensors cut along their first dimension: into equal parts, or by the split
    sizes (rows to receive from, and send to, each rank)."""
    work = _group(group).all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op=async_op)
    return _finish(work, async_op)


@members_only()
def barrier(group: ProcessGroup | None = None, async_op: bool = False, device_ids: list[int] | None = None,
            timeout: timedelta | None = None) -> Work | None:
    """Wait until every rank of the group has reached it; `timeout` replaces the group's for this barrier,
    longer or shorter. `device_ids` is accepted as torch takes it (it picks NCCL's GPU)."""
    return _finish(_group(group).barrier(async_op=async_op, timeout=timeout), async_op)


# How many monitored barriers this process has entered, per group (by its ranks): every member enters
# them in the same order, so the count names the same barrier on every rank.
_monitored: collections.Counter[tuple[int, ...]] = collections.Counter()


@members_only()
def monitored_barrier(group: ProcessGroup | None = None, timeout: timedelta | float | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not reach it: group rank 0 waits for the others until
    `timeout` and raises RuntimeError naming the first one missing (every one with `wait_all_ranks`); the
    others raise once rank 0 does not release them in time. The ranks meet in the job's store, so a late
    arrival never counts for a later barrier."""
    group = _group(group)
    timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout or group.timeout.total_seconds())
    store = default_group().store
    if store is None:
        raise RuntimeError("monitored_barrier needs the job's store, which this default group does not keep")
    _monitored[group.ranks] += 1
    here = store.scoped(f"monitored_barrier/{','.join(map(str, group.ranks))}/{_monitored[group.ranks]}/")
    me = group.ranks[group.rank]
    if group.rank != 0:
        here.set(f"arrived/{me}", True)
        try:
            here.wait(["released"], timeout=timeout)
        except TimeoutError:
            raise RuntimeError(f"monitored_barrier: rank {group.ranks[0]} (group rank 0) did not release global "
                               f"rank {me} within {timeout.total_seconds():g}s") from None
        return
    others = [f"arrived/{r}" for r in group.ranks[1:]]
    try:
        here.wait(others, timeout=timeout)
    except TimeoutError:
        missing = [r for r, key in zip(group.ranks[1:], others, strict=True) if not here.has(key)]
        raise RuntimeError(f"monitored_barrier: rank(s) {missing if wait_all_ranks else missing[:1]} did not "
                           f"reach the barrier within {timeout.total_seconds():g}s") from None
    here.set("released", True)
