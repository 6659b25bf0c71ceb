"""PipelineStage: one stage of a pipeline, with torch.distributed.pipelining's signature, and its traffic
with the neighbouring stages that run on other ranks: each micro-batch's activation metadata and
activations forward, gradients back, over shoal's point-to-point send/recv.

Which group rank runs which stage is the schedule's to say (stage i on rank i for one stage per rank,
round-robin for looped schedules). Sends are asynchronous (isend), so a stage never waits on its own
send; receives are posted ahead and waited for with the group's timeout. Every message has its own tag,
from its kind, the stage that sends it, the tensor's place and the micro-batch, so a receive is matched to
the right send in whatever order a schedule runs its micro-batches, on "shoal" and on "gloo".
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
from torch import nn

import shoal.distributed as dist
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.backends.work import Work
from shoal.errors import CollectiveMismatchError, PeerFailure
from shoal.pipeline.meta import LENGTH, MAX_TENSORS, ActivationMeta, describe

_META, _ACTIVATION, _GRADIENT = range(3)
MAX_MICROBATCHES = 4096
# Far from the small tags people pick for their own send/recv on the same group.
_TAG_BASE = 10_000_000


def _tag(kind: int, sender: int, tensor: int, j: int) -> int:
    return _TAG_BASE + ((((sender * 3 + kind) * MAX_TENSORS + tensor) * MAX_MICROBATCHES) + j)


def _as_tuple(args: torch.Tensor | tuple | None) -> tuple | None:
    return (args,) if isinstance(args, torch.Tensor) else None if args is None else tuple(args)


class Incoming:
    """Posted receives: `tensors` hold the messages once `works` have completed."""

    __slots__ = ("tensors", "works")

    def __init__(self, tensors: list[torch.Tensor], works: list[Work]) -> None:
        self.tensors, self.works = tensors, works


class PipelineStage:
    """Stage `stage_index` of `num_stages`: `submodule`, run by this rank of `group` (the default group
    when None) on `device`.

    Between stages pass a tensor or a tuple of tensors: the outputs of stage i are the positional
    arguments of stage i+1. `input_args` and `output_args` (example tensors for one micro-batch) are
    optional: shapes are learned from every micro-batch, and where given they are checked (count, dtype,
    every dim but dim 0, which an uneven split changes). `output_grads`/`input_grads` describe the
    gradients, which always take their tensors' shapes. `dw_builder` is torch's hook for zero-bubble
    schedules, kept for them; `get_mesh` serves DTensor activations, which shoal does not pass.
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device | str,
                 input_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
                 output_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
                 output_grads: torch.Tensor | tuple[torch.Tensor | None, ...] | None = None,
                 input_grads: torch.Tensor | tuple[torch.Tensor | None, ...] | None = None,
                 group: ProcessGroup | None = None, dw_builder: Callable[[], Callable[..., None]] | None = None,
                 get_mesh: Callable | None = None) -> None:
        if not isinstance(submodule, nn.Module):
            raise TypeError(f"PipelineStage: submodule must be a torch.nn.Module, got {type(submodule).__name__}")
        if num_stages < 1 or not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index={stage_index} with num_stages={num_stages}; need "
                             f"num_stages >= 1 and 0 <= stage_index < num_stages")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = group if group is not None else dist.default_group()
        self.group_rank = self.group.rank
        self.group_size = self.group.size
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.input_args, self.output_args = _as_tuple(input_args), _as_tuple(output_args)
        for name, grads, args in (("input_grads", input_grads, self.input_args),
                                  ("output_grads", output_grads, self.output_args)):
            if grads is not None and args is not None and len(_as_tuple(grads)) != len(args):
                raise ValueError(f"PipelineStage: {name} has {len(_as_tuple(grads))} entries for "
                                 f"{len(args)} tensors")
        self.dw_builder = dw_builder
        self.get_mesh = get_mesh
        self.stage_index_to_group_rank = {s: s % self.group_size for s in range(num_stages)}
        self._sends: list[tuple[Work, torch.Tensor, int]] = []
        # Activation sends by micro-batch, kept apart: the gradient coming back for micro-batch j
        # proves its activations arrived, so their sends (and the outputs they hold) can be let go then,
        # even on a backend whose sends cannot be polled for completion (gloo's).
        self._activation_sends: dict[int, list[tuple[Work, torch.Tensor, int]]] = {}

    def place(self, stage_index_to_group_rank: dict[int, int]) -> None:
        """Take the schedule's placement of stages on group ranks; this rank must be this stage's."""
        rank = stage_index_to_group_rank[self.stage_index]
        if rank != self.group_rank:
            raise ValueError(f"PipelineStage: the schedule runs stage {self.stage_index} on group rank {rank}, but "
                             f"this process is group rank {self.group_rank} (global rank "
                             f"{self.group.ranks[self.group_rank]})")
        self.stage_index_to_group_rank = dict(stage_index_to_group_rank)

    def rank_of(self, stage_index: int) -> int:
        """The global rank that runs stage `stage_index` (point-to-point takes global ranks)."""
        return self.group.ranks[self.stage_index_to_group_rank[stage_index]]

    def is_local(self, stage_index: int) -> bool:
        return self.stage_index_to_group_rank[stage_index] == self.group_rank

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divide the gradients of this stage's parameters by `grad_scale_factor`: the number of
        micro-batches when loss_fn takes a mean, as the unsplit batch's gradient is their mean."""
        if grad_scale_factor != 1:
            for parameter in self.submod.parameters():
                if parameter.grad is not None:
                    parameter.grad.div_(grad_scale_factor)

    def check_declared(self, which: str, shapes: tuple, dtypes: tuple) -> None:
        """Raise if tensors disagree with the `input_args`/`output_args` this stage was built with."""
        declared = self.input_args if which == "input_args" else self.output_args
        if declared is None:
            return
        got = ", ".join(describe(s, d) for s, d in zip(shapes, dtypes, strict=True))
        agree = len(declared) == len(shapes) and all(
            t.dtype == d and tuple(t.shape[1:]) == tuple(s[1:]) for t, s, d in zip(declared, shapes, dtypes,
                                                                                    strict=False))
        if not agree:
            want = ", ".join(describe(t.shape, t.dtype) for t in declared)
            raise ValueError(f"stage {self.stage_index}: {which} declared {want}, but the micro-batch has {got}")

    # ---- sending (asynchronous; `finish_sends` waits) -----------------------------------------

    def send_activations(self, meta: ActivationMeta, tensors: tuple[torch.Tensor, ...]) -> None:
        dst, j = self.rank_of(self.stage_index + 1), meta.microbatch
        self._sends.append(self._isend(meta.encode().to(self.device), dst, _tag(_META, self.stage_index, 0, j)))
        self._activation_sends[j] = [self._isend(t.detach(), dst, _tag(_ACTIVATION, self.stage_index, k, j))
                                     for k, t in enumerate(tensors)]

    def send_gradients(self, j: int, gradients: list[torch.Tensor | None]) -> None:
        dst = self.rank_of(self.stage_index - 1)
        for k, gradient in enumerate(gradients):
            if gradient is not None:
                self._sends.append(self._isend(gradient, dst, _tag(_GRADIENT, self.stage_index, k, j)))

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> tuple[Work, torch.Tensor, int]:
        # The tensor sent stays referenced until its send is done: the backend may still be reading it.
        tensor = tensor.contiguous()
        return dist.isend(tensor, dst, group=self.group, tag=tag), tensor, dst

    @staticmethod
    def _settle(send: tuple[Work, torch.Tensor, int]) -> None:
        """Wait for a send; a failure names its destination where the backend could not (gloo)."""
        work, _, dst = send
        try:
            work.wait()
        except PeerFailure as exc:
            if exc.rank is not None:
                raise
            raise PeerFailure(dst, exc.detail) from exc

    def reap_sends(self) -> None:
        """Forget sends that are done, raising the error of one that failed (a neighbour that died)."""
        pending = []
        for send in self._sends:
            if send[0].is_completed():
                self._settle(send)
            else:
                pending.append(send)
        self._sends = pending
        for j in [j for j, sends in self._activation_sends.items() if all(s[0].is_completed() for s in sends)]:
            for send in self._activation_sends.pop(j):
                self._settle(send)

    def finish_sends(self) -> None:
        """Wait for every send of this step (each within the group's timeout)."""
        sends = self._sends + [send for sends in self._activation_sends.values() for send in sends]
        self.forget_sends()
        for send in sends:
            self._settle(send)

    def forget_sends(self) -> None:
        """Drop sends a failed step left behind; their works keep their own tensors alive."""
        self._sends = []
        self._activation_sends = {}

    # ---- receiving -----------------------------------------------------------------------------

    def post_meta(self, j: int) -> Incoming:
        buffer = torch.empty(LENGTH, dtype=torch.int64, device=self.device)
        src = self.stage_index - 1
        return Incoming([buffer], [dist.irecv(buffer, self.rank_of(src), group=self.group,
                                              tag=_tag(_META, src, 0, j))])

    def take_meta(self, incoming: Incoming, j: int) -> ActivationMeta:
        self._wait(incoming.works[0], f"the activation metadata of micro-batch {j}", self.stage_index - 1)
        return ActivationMeta.decode(incoming.tensors[0])

    def post_activations(self, meta: ActivationMeta) -> Incoming:
        src, j = self.stage_index - 1, meta.microbatch
        return self._post(meta, src, lambda k: _tag(_ACTIVATION, src, k, j), range(len(meta.shapes)))

    def post_gradients(self, meta: ActivationMeta) -> Incoming:
        """Receive the gradients of the activations `meta` describes, for those that carry one (floating)."""
        src, j = self.stage_index + 1, meta.microbatch
        floating = [k for k, dtype in enumerate(meta.dtypes) if dtype.is_floating_point]
        return self._post(meta, src, lambda k: _tag(_GRADIENT, src, k, j), floating)

    def _post(self, meta: ActivationMeta, src: int, tag: Callable[[int], int], which) -> Incoming:
        tensors, works = [], []
        for k in which:
            buffer = torch.empty(meta.shapes[k], dtype=meta.dtypes[k], device=self.device)
            tensors.append(buffer)
            works.append(dist.irecv(buffer, self.rank_of(src), group=self.group, tag=tag(k)))
        return Incoming(tensors, works)

    def take_activations(self, incoming: Incoming, meta: ActivationMeta) -> list[torch.Tensor]:
        i, j = self.stage_index, meta.microbatch
        try:
            for work in incoming.works:
                self._wait(work, f"the activations of micro-batch {j}", i - 1)
        except CollectiveMismatchError as exc:
            raise CollectiveMismatchError(f"stage {i} expected the activations of micro-batch {j} from stage {i - 1} "
                                          f"({meta.describe()}), as their metadata said, but received others: "
                                          f"{exc}") from exc
        return incoming.tensors

    def take_gradients(self, incoming: Incoming, meta: ActivationMeta) -> list[torch.Tensor]:
        i, j = self.stage_index, meta.microbatch
        try:
            for work in incoming.works:
                self._wait(work, f"the gradients of micro-batch {j}", i + 1)
        except CollectiveMismatchError as exc:
            raise CollectiveMismatchError(f"stage {i} sent stage {i + 1} the activations of micro-batch {j} "
                                          f"({meta.describe()}), but the gradients stage {i + 1} sent back do not "
                                          f"match them: {exc}") from exc
        for send in self._activation_sends.pop(j, []):
            self._settle(send)  # done: stage i+1 received them before it could answer
        return incoming.tensors

    def _wait(self, work: Work, what: str, peer_stage: int) -> None:
        peer_rank = self.rank_of(peer_stage)
        try:
            work.wait()
        except TimeoutError as exc:
            seconds = self.group.timeout / timedelta(seconds=1)
            raise TimeoutError(f"stage {self.stage_index}: {what} from stage {peer_stage} (rank "
                               f"{peer_rank}) did not arrive within {seconds:g}s: {exc}") from exc
        except PeerFailure as exc:  # name the stage, and the rank where the backend could not (gloo)
            raise PeerFailure(peer_rank if exc.rank is None else exc.rank,
                              f"stage {self.stage_index} waited for {what} from stage {peer_stage}: "
                              f"{exc.detail}") from exc
