"""Pipeline schedules, with torch.distributed.pipelining's classes and signatures: they cut a batch into
micro-batches and run this rank's forwards and backwards in their order.

    stage = PipelineStage(part, rank, world_size, device)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.functional.cross_entropy)
    if stage.is_first:
        schedule.step(x)                                # the batch, cut along dim 0
    elif stage.is_last:
        out = schedule.step(target=y, losses=losses)    # merged output; losses of the micro-batches
    else:
        schedule.step()
    optimizer.step()

One stage per rank: ScheduleGPipe, Schedule1F1B. Several stages per rank (pass this rank's stages),
stage s on group rank s % group size: ScheduleInterleaved1F1B, ScheduleLoopedBFS,
ScheduleInterleavedZeroBubble; two per rank in a V, rank r running stages r and 2*ranks-1-r:
ScheduleZBVZeroBubble, ScheduleDualPipeV.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch

from shoal.pipeline import orders
from shoal.pipeline.microbatch import merge_chunks, split_args_kwargs_into_chunks
from shoal.pipeline.orders import Action
from shoal.pipeline.stage import MAX_MICROBATCHES, PipelineStage
from shoal.pipeline.step_run import StepRun


class _PipelineSchedule(abc.ABC):
    """What every schedule shares: checking and cutting a step's arguments, running the order, the losses,
    merging outputs. A subclass says only which stage runs where and in which order actions run.

    With a `loss_fn` a step trains: the last stage computes `loss_fn(output, target)` per micro-batch,
    every stage runs backward, and each parameter's `.grad` accumulates the micro-batches' gradients,
    divided at the end by n_microbatches when `scale_grads` (right for a loss_fn that takes a mean; all
    of the stage's gradients are divided, as torch does). Without a `loss_fn`, or in `eval`, a step is
    forward only. Every stage must be built the same way; a disagreement (loss_fn on some stages only,
    other n_microbatches) raises ValueError naming both stages.

    If step raises after communication began, the stages are out of step: destroy the process group (the
    neighbours see `PeerFailure` when this rank leaves it, or `TimeoutError`). Argument errors are raised
    before anything is sent, and the pipeline remains usable.
    """

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None,
                 args_chunk_spec: tuple | None, kwargs_chunk_spec: dict | None, output_merge_spec: Any,
                 scale_grads: bool, backward_requires_autograd: bool = True, defer_pp_recv: bool = False) -> None:
        name = type(self).__name__
        if not stages or not all(isinstance(stage, PipelineStage) for stage in stages):
            raise TypeError(f"{name}: needs PipelineStage objects, got {[type(s).__name__ for s in stages]}")
        if not isinstance(n_microbatches, int) or not 1 <= n_microbatches <= MAX_MICROBATCHES:
            raise ValueError(f"{name}: n_microbatches must be an int from 1 to {MAX_MICROBATCHES}, "
                             f"got {n_microbatches!r}")
        first = stages[0]
        if any(s.group is not first.group or s.num_stages != first.num_stages for s in stages):
            raise ValueError(f"{name}: this rank's stages must share one group and one num_stages")
        self._stages = sorted(stages, key=lambda stage: stage.stage_index)
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._has_backward = loss_fn is not None
        self._args_chunk_spec, self._kwargs_chunk_spec = args_chunk_spec, kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        self._backward_requires_autograd = backward_requires_autograd
        self._defer_pp_recv = defer_pp_recv
        self.pp_group_size, self.rank = first.group_size, first.group_rank
        self.stage_index_to_group_rank = self._placement()
        mine = sorted(s for s, rank in self.stage_index_to_group_rank.items() if rank == self.rank)
        given = [stage.stage_index for stage in self._stages]
        if given != mine:
            raise ValueError(f"{name}: group rank {self.rank} of {self.pp_group_size} runs stages {mine} of "
                             f"{first.num_stages}, but was given stages {given}")
        for stage in self._stages:
            stage.place(self.stage_index_to_group_rank)
        self.peak_live_microbatches = 0
        """The most micro-batches whose activations this rank held at once during the last step."""

    @abc.abstractmethod
    def _placement(self) -> dict[int, int]:
        """Which group rank runs each stage."""

    @abc.abstractmethod
    def _order(self) -> list[Action]:
        """This rank's forwards and backwards of one training step, in the order they run."""

    def step(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict[str, Any] | None = None, **kwargs):
        """Run one step over the whole batch. The rank with the first stage passes the batch (`args`,
        `kwargs`, cut by the chunk specs); the rank with the last stage passes `target` (cut along dim 0)
        and gets the merged output (when `return_outputs`). Other ranks' arguments are not used."""
        if self._has_backward and self._backward_requires_autograd and not torch.is_grad_enabled():
            raise RuntimeError(f"{type(self).__name__}.step trains (it has a loss_fn) and needs gradients enabled; "
                               f"do not call it under torch.no_grad(), call eval() instead")
        m, first, last = self._n_microbatches, self._stages[0], self._stages[-1]
        arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks(args, kwargs, m, self._args_chunk_spec,
                                                           self._kwargs_chunk_spec)
        if first.is_first and not args and not kwargs:
            raise ValueError(f"{type(self).__name__}.step: the rank with the first stage must pass the batch")
        target_mbs = None
        if last.is_last and target is not None:
            target_mbs = split_args_kwargs_into_chunks((target,), None, m)[0]
            target_mbs = [piece[0] for piece in target_mbs]
        if last.is_last and self._has_backward and target is None:
            raise ValueError(f"{type(self).__name__}.step: the rank with the last stage computes the loss and needs "
                             f"target=")
        training = self._has_backward
        run = StepRun({stage.stage_index: stage for stage in self._stages}, m, training, self._loss_fn, arg_mbs,
                      kwarg_mbs, target_mbs, loss_kwargs, keep_outputs=return_outputs)
        for stage in self._stages:
            stage.forget_sends()
        order = self._order() if training else [action for action in self._order() if action[0] == "F"]
        try:
            with torch.set_grad_enabled(training):
                run.execute(order, lookahead=not self._defer_pp_recv)
        finally:
            self.peak_live_microbatches = run.peak
        if training:
            for stage in self._stages:
                stage.scale_grads(m if self.scale_grads else 1)
        if last.is_last and losses is not None:
            losses.clear()
            losses.extend(run.losses[j] for j in sorted(run.losses))
        if last.is_last and return_outputs:
            return merge_chunks([run.outputs[j] for j in range(m)], self._output_merge_spec)
        return None

    def eval(self, *args, target=None, losses: list | None = None, **kwargs):
        """Run one step forward only; with a loss_fn and target, the losses are still computed."""
        has_backward = self._has_backward
        try:
            self._has_backward = False
            return self.step(*args, target=target, losses=losses, **kwargs)
        finally:
            self._has_backward = has_backward


class _PipelineScheduleSingle(_PipelineSchedule):
    """One stage per rank: stage i on group rank i of a group of num_stages ranks."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple | None = None, kwargs_chunk_spec: dict | None = None,
                 output_merge_spec: Any = None, scale_grads: bool = True) -> None:
        if isinstance(stage, PipelineStage) and stage.group_size != stage.num_stages:
            raise ValueError(f"{type(self).__name__}: num_stages={stage.num_stages} but the group has "
                             f"{stage.group_size} ranks {list(stage.group.ranks)}; run one stage per rank of the "
                             f"group, or a schedule with several stages per rank")
        super().__init__([stage], n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)
        self._stage = stage

    def _placement(self) -> dict[int, int]:
        return {s: s for s in range(self._stages[0].num_stages)}


class ScheduleGPipe(_PipelineScheduleSingle):
    """GPipe: the forwards of all micro-batches, then their backwards in the same order."""

    def _order(self) -> list[Action]:
        return orders.gpipe(self._stage.stage_index, self._n_microbatches)


class Schedule1F1B(_PipelineScheduleSingle):
    """1F1B: after warm-up forwards, one forward and one backward in turn; a stage holds the activations
    of at most num_stages - stage_index micro-batches, whatever n_microbatches is."""

    def _order(self) -> list[Action]:
        return orders.one_f_one_b(self._stage.stage_index, self._stage.num_stages, self._n_microbatches)


class _PipelineScheduleMulti(_PipelineSchedule):
    """Several stages per rank, looped: stage s on group rank s % group size."""

    def _placement(self) -> dict[int, int]:
        num_stages = self._stages[0].num_stages
        if num_stages % self.pp_group_size:
            raise ValueError(f"{type(self).__name__}: num_stages={num_stages} must be a multiple of the group's "
                             f"{self.pp_group_size} ranks")
        return {s: s % self.pp_group_size for s in range(num_stages)}


class _CheckedOrderSchedule(_PipelineSchedule):
    """A schedule with several stages per rank whose order may refuse some n_microbatches: refused when
    built, not at the first step."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple | None = None, kwargs_chunk_spec: dict | None = None,
                 output_merge_spec: Any = None, scale_grads: bool = True, backward_requires_autograd: bool = True,
                 defer_pp_recv: bool = False) -> None:
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads, backward_requires_autograd, defer_pp_recv)
        try:
            self._order()
        except ValueError as exc:
            raise ValueError(f"{type(self).__name__}: {exc}") from None


class ScheduleInterleaved1F1B(_CheckedOrderSchedule, _PipelineScheduleMulti):
    """Interleaved 1F1B (depth first): 1F1B over this rank's stages, a round of micro-batches through one
    stage before the next; smaller bubbles than 1F1B for the same micro-batches."""

    def _order(self) -> list[Action]:
        return orders.interleaved_1f1b(self.rank, self.pp_group_size, len(self._stages), self._n_microbatches)


class ScheduleInterleavedZeroBubble(_CheckedOrderSchedule, _PipelineScheduleMulti):
    """Interleaved zero bubble (ZB1P): interleaved 1F1B with each backward split into the gradients of the
    stage's inputs, sent back at once, and of its weights, run where the rank would otherwise wait."""

    def _order(self) -> list[Action]:
        return orders.interleaved_1f1b(self.rank, self.pp_group_size, len(self._stages), self._n_microbatches,
                                       zero_bubble=True)


class _PipelineScheduleV(_PipelineSchedule):
    """Two stages per rank in a V: rank r runs stage r and stage 2*ranks-1-r."""

    def _placement(self) -> dict[int, int]:
        p, num_stages = self.pp_group_size, self._stages[0].num_stages
        if num_stages != 2 * p:
            raise ValueError(f"{type(self).__name__}: runs exactly two stages per rank; num_stages={num_stages} "
                             f"but the group has {p} ranks")
        return {s: s if s < p else 2 * p - 1 - s for s in range(num_stages)}


class ScheduleZBVZeroBubble(_CheckedOrderSchedule, _PipelineScheduleV):
    """ZB-V: a V of stages, backwards split in two, weight halves filling the bubbles."""

    def _order(self) -> list[Action]:
        return orders.zbv_zero_bubble(self.rank, self.pp_group_size, self._n_microbatches)


class ScheduleDualPipeV(_CheckedOrderSchedule, _PipelineScheduleV):
    """DualPipeV: a V of stages, a forward on one leg paired with a backward on the other in the steady
    state (torch overlaps them on a GPU; here they run in turn), the drain filled with weight halves."""

    def _order(self) -> list[Action]:
        return orders.dualpipe_v(self.rank, self.pp_group_size, self._n_microbatches)


class ScheduleLoopedBFS(_PipelineScheduleMulti):
    """Breadth-first (Lamy-Poirier 2023): every micro-batch through this rank's earlier stage before its
    next; backwards from the last stage."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 output_merge_spec: Any = None, scale_grads: bool = True, backward_requires_autograd: bool = True,
                 defer_pp_recv: bool = False) -> None:
        super().__init__(stages, n_microbatches, loss_fn, None, None, output_merge_spec, scale_grads,
                         backward_requires_autograd, defer_pp_recv)

    def _order(self) -> list[Action]:
        return orders.looped_bfs(self.rank, self.pp_group_size, len(self._stages), self._n_microbatches)
