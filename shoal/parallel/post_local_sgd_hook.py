"""The post-local SGD communication hook: DistributedDataParallel averages gradients over the whole group for
the first `start_localSGD_iter` backward passes, then only within a subgroup (a host's ranks, say), or not
at all; a model averager (`PeriodicModelAverager`, or `PostLocalSGDOptimizer` around the optimizer) then
averages the parameters over everyone every few steps. torch's post_localSGD_hook and PostLocalSGDState.

    state = PostLocalSGDState(process_group=None, subgroup=my_host_group, start_localSGD_iter=100)
    model.register_comm_hook(state, post_localSGD_hook)
"""

from __future__ import annotations

import logging

from shoal.comm.api import group, new_subgroups
from shoal.comm.backends.group import DEFAULT_TIMEOUT, ProcessGroup
from shoal.comm.backends.work import AllOf
from shoal.parallel.comm_hooks import GradBucket, Pending, _divide_then_sum

logger = logging.getLogger(__name__)


class PostLocalSGDState:
    """Which group averages gradients: `process_group` (None: the default group) until `start_localSGD_iter`
    backward passes have synchronized, then `subgroup` (None: one per host's GPUs, from `new_subgroups()`),
    or nobody with `post_local_gradient_allreduce=False`. `iter` counts synchronized backward passes, at
    each one's last bucket, up to `start_localSGD_iter`."""

    __slots__ = ("iter", "post_local_gradient_allreduce", "process_group", "start_localSGD_iter", "subgroup")

    def __init__(self, process_group: ProcessGroup | None, subgroup: ProcessGroup | None, start_localSGD_iter: int,
                 post_local_gradient_allreduce: bool = True) -> None:
        logger.info("Local SGD will be started after %s iterations", start_localSGD_iter)
        self.process_group = process_group
        self.subgroup = subgroup
        self.start_localSGD_iter = start_localSGD_iter
        self.post_local_gradient_allreduce = post_local_gradient_allreduce
        self.iter = 0

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count a backward pass at its last bucket."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_localSGD_iter:
                logger.info("Start to apply local SGD after %s iterations.", self.iter)


def _average(process_group: ProcessGroup, bucket: GradBucket) -> Pending:
    return Pending(_divide_then_sum(bucket.buffer(), process_group), bucket.buffer)


def post_localSGD_hook(state: PostLocalSGDState, bucket: GradBucket) -> Pending:
    """Average the bucket over the whole group during warm-up, then within the subgroup (or not at all)."""
    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        return _average(state.process_group if state.process_group is not None else group.WORLD, bucket)
    if not state.post_local_gradient_allreduce:
        # Nothing to communicate: a Work of no parts, complete at once; the bucket keeps the local gradients.
        return Pending(AllOf("post_localSGD_hook: local gradients", [], DEFAULT_TIMEOUT), bucket.buffer)
    if state.subgroup is None:
        state.subgroup, _ = new_subgroups()
    return _average(state.subgroup, bucket)
