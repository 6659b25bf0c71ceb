"""DistributedDataParallel under Join: the collectives a rank that has run out of inputs makes, so that
the live ranks' forward and backward find theirs matched (torch's DDP join hook).

In a join context, a live rank's forward, after Join's notification, all-reduces a 1 if its step will
synchronize gradients (`_announce_step`); a joined rank's `main_hook` meets it with a 0 and, if some rank
synchronizes, matches the rest of that step in the same order: the choice of the rank whose buffers
everyone takes (the highest live one: a joined rank's are stale) and their broadcast, one reduction of
zeros per bucket in bucket order, and the used-parameter flags. Once all have joined, `post_hook`
gives every rank the model of the highest rank among those that joined last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.backends.group import ProcessGroup
from shoal.parallel.comm_hooks import GradBucket
from shoal.parallel.join import JoinHook

if TYPE_CHECKING:
    from shoal.parallel.ddp import DistributedDataParallel


class DDPJoinHook(JoinHook):
    """Shadows a DistributedDataParallel's synchronizing steps while joined; syncs the model at the end."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        if _announce_step(ddp, syncs=False)() == 0:
            return  # the live ranks' step does not synchronize (no_sync, or no grad): nothing more to match
        if ddp._syncs_buffers():
            ddp._sync_from(list(ddp.module.buffers()), _common_rank(ddp, candidate=False))
        _shadow_reduction(ddp)

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        tensors = [*ddp.module.parameters(), *(ddp.module.buffers() if ddp.broadcast_buffers else ())]
        ddp._sync_from(tensors, _common_rank(ddp, candidate=is_last_joiner))


def _announce_step(ddp: DistributedDataParallel, syncs: bool) -> Callable[[], int]:
    """All-reduce whether this rank's step synchronizes gradients (a joined rank's never does). Returns a
    function that gives how many ranks' steps do (the live ranks, when they train): the first call waits
    and reads the count, later calls give it again, so that a step with many buckets syncs with the
    device once (`.item()`), not once per bucket."""
    flag = torch.tensor([1.0 if syncs else 0.0], device=ddp.join_device)
    work = ddp.process_group.all_reduce(flag)
    counted: list[int] = []

    def count() -> int:
        if not counted:
            work.wait()
            counted.append(int(flag.item()))
        return counted[0]
    return count


def _common_rank(ddp: DistributedDataParallel, candidate: bool) -> int:
    """The global rank of the highest group rank among the candidates, agreed by every rank."""
    group: ProcessGroup = ddp.process_group
    rank = torch.tensor([group.rank if candidate else -1], device=ddp.join_device)
    group.all_reduce(rank, ReduceOp.MAX).wait()
    assert rank.item() >= 0, "some rank is a candidate: a live one, or one that joined last"
    return group.ranks[int(rank.item())]


def _shadow_reduction(ddp: DistributedDataParallel) -> None:
    """Zeros through the communication hook for every bucket, in bucket order, as the live ranks reduce
    their gradients (where they lie or packed: the collective is the same), then the used-parameter
    flags if the live ranks exchange them. Fresh zeros: this rank's own `.grad` and buckets stay as they are."""
    pending = []
    for bucket in ddp.buckets:
        zeros = torch.zeros(bucket.offsets[-1], dtype=bucket.params[0].dtype, device=bucket.params[0].device)
        pending.append(ddp._hook(ddp._hook_state, GradBucket(bucket, zeros, ddp.process_group,
                                                              last=bucket.index == len(ddp.buckets) - 1)))
    if ddp.find_unused_parameters:
        flags = torch.zeros(sum(len(b.params) for b in ddp.buckets), dtype=torch.int32,
                            device=ddp.process_group.device)
        ddp.process_group.all_reduce(flags).wait()
    for reduction in pending:
        reduction.wait()
