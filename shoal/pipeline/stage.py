"""PipelineStage: one stage of a pipeline, on one rank, and its traffic with the neighbouring stages: the
step header and activations forward, gradients back, over shoal's point-to-point send/recv.

Stage i runs on rank i of its group. Sends are asynchronous (isend), so a stage never waits on its own
send; receives are posted ahead and waited for with the group's timeout. Each kind of message has its
own tag, and every kind travels in one direction in micro-batch order, so a receive is matched to the
right send whether the backend pairs messages per (peer, tag), as "shoal" and "gloo" do, or per peer.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import torch
from torch import nn

import shoal.distributed as dist
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.backends.work import Work
from shoal.errors import CollectiveMismatchError, PeerFailure
from shoal.pipeline.header import LENGTH, StepHeader

# Far from the small tags people pick for their own send/recv on the same group.
_HEADER_TAG, _ACTIVATION_TAG, _GRADIENT_TAG = 7_700_001, 7_700_002, 7_700_003


class Incoming:
    """A posted receive: `tensor` holds the message once `work` has completed."""

    __slots__ = ("tensor", "work")

    def __init__(self, tensor: torch.Tensor, work: Work) -> None:
        self.tensor, self.work = tensor, work


def describe(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> str:
    return f"of shape {tuple(shape)} dtype {str(dtype).removeprefix('torch.')}"


class PipelineStage:
    """Stage `stage_index` of `num_stages`: `module` on this rank, which must be rank `stage_index` of
    `group` (the default group when None), a group of exactly `num_stages` ranks.

    A schedule (`ScheduleGPipe`, `Schedule1F1B`) drives it. Between stages passes a single tensor whose
    dim 0 is the micro-batch; received activations are allocated on the device of the module's
    parameters (CPU if it has none).
    """

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, *,
                 group: ProcessGroup | None = None) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"PipelineStage: module must be a torch.nn.Module, got {type(module).__name__}")
        if num_stages < 1 or not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index={stage_index} with num_stages={num_stages}; need "
                             f"num_stages >= 1 and 0 <= stage_index < num_stages")
        self.group = group if group is not None else dist.default_group()
        if self.group.size != num_stages:
            raise ValueError(f"PipelineStage: num_stages={num_stages} but the group has {self.group.size} ranks "
                             f"{list(self.group.ranks)}; run one stage per rank of the group")
        if self.group.rank != stage_index:
            raise ValueError(f"PipelineStage: stage_index={stage_index} but this process is rank {self.group.rank} "
                             f"of the group (global rank {self.group.ranks[self.group.rank]}); stage i must run "
                             f"on group rank i")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        # Global ranks of the neighbours: point-to-point takes global ranks, even within a subgroup.
        self.prev_rank = None if self.is_first else self.group.ranks[stage_index - 1]
        self.next_rank = None if self.is_last else self.group.ranks[stage_index + 1]
        tensors = itertools.chain(module.parameters(), module.buffers())
        self.device = next((t.device for t in tensors), torch.device("cpu"))
        self._sends: list[tuple[Work, torch.Tensor, int]] = []
        # Activation sends by micro-batch, kept apart: the gradient coming back for micro-batch j
        # proves its activation arrived, so its send (and the output it holds) can be let go then,
        # even on a backend whose sends cannot be polled for completion (gloo's).
        self._activation_sends: dict[int, tuple[Work, torch.Tensor, int]] = {}

    # ---- sending (asynchronous; `finish_sends` waits) -----------------------------------------

    def send_header(self, header: StepHeader) -> None:
        self._sends.append(self._isend(header.encode().to(self.device), self.next_rank, _HEADER_TAG))

    def send_activation(self, tensor: torch.Tensor, j: int) -> None:
        self._activation_sends[j] = self._isend(tensor.detach(), self.next_rank, _ACTIVATION_TAG)

    def send_gradient(self, tensor: torch.Tensor) -> None:
        self._sends.append(self._isend(tensor, self.prev_rank, _GRADIENT_TAG))

    def _isend(self, tensor: torch.Tensor, dst: int | None, tag: int) -> tuple[Work, torch.Tensor, int]:
        assert dst is not None, "no stage to send to"
        # The tensor stays referenced until its send is done: the backend may still be reading it.
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
        for j in [j for j, (work, _, _) in self._activation_sends.items() if work.is_completed()]:
            self._settle(self._activation_sends.pop(j))

    def finish_sends(self) -> None:
        """Wait for every send of this step (each within the group's timeout)."""
        sends = self._sends + list(self._activation_sends.values())
        self.forget_sends()
        for send in sends:
            self._settle(send)

    def forget_sends(self) -> None:
        """Drop sends a failed step left behind; their works keep their own tensors alive."""
        self._sends = []
        self._activation_sends = {}

    # ---- receiving -----------------------------------------------------------------------------

    def recv_header(self) -> StepHeader:
        buffer = torch.empty(LENGTH, dtype=torch.int64, device=self.device)
        self._wait(dist.irecv(buffer, self.prev_rank, group=self.group, tag=_HEADER_TAG),
                   "the step header", self.stage_index - 1)
        return StepHeader.decode(buffer)

    def post_activation(self, shape: tuple[int, ...], dtype: torch.dtype) -> Incoming:
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        return Incoming(buffer, dist.irecv(buffer, self.prev_rank, group=self.group, tag=_ACTIVATION_TAG))

    def post_gradient(self, shape: tuple[int, ...], dtype: torch.dtype) -> Incoming:
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        return Incoming(buffer, dist.irecv(buffer, self.next_rank, group=self.group, tag=_GRADIENT_TAG))

    def take_activation(self, incoming: Incoming, j: int) -> torch.Tensor:
        i = self.stage_index
        try:
            self._wait(incoming.work, f"the activation of micro-batch {j}", i - 1)
        except CollectiveMismatchError as exc:
            raise CollectiveMismatchError(
                f"stage {i} expected the activation of micro-batch {j} from stage {i - 1} "
                f"{describe(incoming.tensor.shape, incoming.tensor.dtype)}, as stage {i - 1}'s step header said, "
                f"but received another: {exc}") from exc
        return incoming.tensor

    def take_gradient(self, incoming: Incoming, j: int) -> torch.Tensor:
        i = self.stage_index
        try:
            self._wait(incoming.work, f"the gradient of micro-batch {j}", i + 1)
        except CollectiveMismatchError as exc:
            raise CollectiveMismatchError(
                f"stage {i} sent stage {i + 1} the activation of micro-batch {j} "
                f"{describe(incoming.tensor.shape, incoming.tensor.dtype)}, but the gradient stage {i + 1} sent back "
                f"does not match it: {exc}") from exc
        sent = self._activation_sends.pop(j, None)
        if sent is not None:
            self._settle(sent)  # done: stage i+1 received it before it could answer
        return incoming.tensor

    def _wait(self, work: Work, what: str, peer_stage: int) -> None:
        peer_rank = self.group.ranks[peer_stage]
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
