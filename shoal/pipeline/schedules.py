"""Pipeline schedules: ScheduleGPipe and Schedule1F1B split a batch into micro-batches and run this
stage's forwards and backwards in their order, with torch.distributed.pipelining's interface.

    stage = PipelineStage(part, rank, world_size)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.functional.cross_entropy)
    if stage.is_first:
        schedule.step(x)                                # the batch, split along dim 0
    elif stage.is_last:
        out = schedule.step(target=y, losses=losses)    # merged output; per-micro-batch losses appended
    else:
        schedule.step()
    optimizer.step()                                    # .grad holds the whole batch's gradient
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable

import torch

from shoal.observe import events
from shoal.pipeline.header import StepHeader, check_describable, microbatch_sizes
from shoal.pipeline.stage import Incoming, PipelineStage, describe

Action = tuple[str, int]  # ("F", j): forward of micro-batch j; ("B", j): its backward


class _PipelineSchedule(abc.ABC):
    """What both schedules share: checking and splitting the step's arguments, one forward or backward of
    a micro-batch, the loss, merging outputs. A subclass says only in which order actions run.

    With a `loss_fn` a step trains: the last stage computes `loss_fn(output, target)` per micro-batch and
    every stage runs backward, so that afterwards each parameter's `.grad` has accumulated (as a plain
    backward does) exactly the gradient that the unsplit model, given the whole batch and a mean-reduced
    loss_fn, would have produced. Without a `loss_fn` a step is forward-only (inference): no gradients, no
    activations kept, and the last stage returns the merged output. Every stage must be built the same
    way; a disagreement (loss_fn on some stages only, other n_microbatches) raises ValueError naming both
    stages.

    If step raises after communication began, the stages are out of step: destroy the process group (the
    neighbours see `PeerFailure` when this rank leaves it, or `TimeoutError`). Argument errors are raised
    before anything is sent, and the pipeline remains usable.
    """

    def __init__(self, stage: PipelineStage, n_microbatches: int, *,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"{type(self).__name__}: stage must be a PipelineStage, got {type(stage).__name__}")
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"{type(self).__name__}: n_microbatches must be a positive int, got {n_microbatches!r}")
        self.stage = stage
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.peak_live_microbatches = 0
        """The most micro-batches whose activations this stage held at once during the last step."""

    @abc.abstractmethod
    def _order(self) -> list[Action]:
        """This stage's forwards and backwards of one training step, in the order they run."""

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None,
             losses: list[torch.Tensor] | None = None) -> torch.Tensor | None:
        """Run one step over the whole batch. The first stage passes the batch (`inputs`, split along
        dim 0 as `torch.tensor_split` does), the last stage passes `target` (split the same way) and
        gets the merged output; the others pass nothing and get None."""
        training = self.loss_fn is not None
        self._check_arguments(inputs, target, losses, training)
        if training and not torch.is_grad_enabled():
            raise RuntimeError(f"{type(self).__name__}.step trains (it has a loss_fn) and needs gradients enabled; "
                               f"do not call it under torch.no_grad(), use a schedule without loss_fn for inference")
        run = _StepRun(self, inputs, target, training)
        self.stage.forget_sends()
        try:
            with torch.set_grad_enabled(training):
                run.execute(self._order() if training else [("F", j) for j in range(self.n_microbatches)])
            self.stage.finish_sends()
        finally:
            self.peak_live_microbatches = run.peak
        if losses is not None:
            losses.extend(run.losses)
        return torch.cat(run.outputs) if self.stage.is_last else None

    def _check_arguments(self, inputs: tuple, target: torch.Tensor | None, losses: list | None,
                         training: bool) -> None:
        stage, name = self.stage, f"{type(self).__name__}.step on stage {self.stage.stage_index}"
        if stage.is_first and not inputs:
            raise ValueError(f"{name}: the first stage must pass the batch")
        if not stage.is_first and inputs:
            raise ValueError(f"{name}: only the first stage (stage 0) passes the batch; got {len(inputs)} inputs")
        for k, tensor in enumerate(inputs):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
                raise TypeError(f"{name}: input {k} must be a tensor with the batch as dim 0, got "
                                f"{type(tensor).__name__}{list(getattr(tensor, 'shape', []))}")
            if len(tensor) != len(inputs[0]):
                raise ValueError(f"{name}: input {k} has {len(tensor)} rows but input 0 has {len(inputs[0])}")
        if inputs and len(inputs[0]) < self.n_microbatches:
            raise ValueError(f"{name}: the batch has {len(inputs[0])} rows, fewer than n_microbatches="
                             f"{self.n_microbatches}; every micro-batch needs at least one row")
        if not stage.is_last and (target is not None or losses is not None):
            raise ValueError(f"{name}: only the last stage (stage {stage.num_stages - 1}) takes target and losses")
        if stage.is_last and training and (not isinstance(target, torch.Tensor) or target.dim() == 0):
            raise ValueError(f"{name}: the last stage computes the loss and needs target= with the batch as dim 0, "
                             f"got {target!r}")
        if stage.is_last and not training and (target is not None or losses is not None):
            raise ValueError(f"{name}: target and losses need a loss_fn; this schedule is forward-only")


class ScheduleGPipe(_PipelineSchedule):
    """GPipe: the forwards of all micro-batches, then their backwards in the same order (micro-batch 0
    first), so a stage holds the activations of all `n_microbatches` at the peak."""

    def _order(self) -> list[Action]:
        m = self.n_microbatches
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]


class Schedule1F1B(_PipelineSchedule):
    """1F1B: stage i runs (num_stages - i - 1) warm-up forwards (at most n_microbatches), then alternates
    one forward and one backward, then runs the remaining backwards. A stage holds the activations of at
    most num_stages - i micro-batches at once, whatever n_microbatches is."""

    def _order(self) -> list[Action]:
        m = self.n_microbatches
        warmup = min(self.stage.num_stages - self.stage.stage_index - 1, m)
        steady = [action for k in range(m - warmup) for action in (("F", warmup + k), ("B", k))]
        return [("F", j) for j in range(warmup)] + steady + [("B", j) for j in range(m - warmup, m)]


class _StepRun:
    """The state of one step on one stage: micro-batches, posted receives, what backward still needs."""

    def __init__(self, schedule: _PipelineSchedule, inputs: tuple[torch.Tensor, ...], target: torch.Tensor | None,
                 training: bool) -> None:
        self.stage = schedule.stage
        self.module = schedule.stage.module
        self.loss_fn = schedule.loss_fn
        self.m = schedule.n_microbatches
        self.training = training
        self.inputs = list(zip(*(torch.tensor_split(t, self.m) for t in inputs), strict=True)) if inputs else []
        self.target = target
        self.targets: list[torch.Tensor] = []
        self.batch_size = len(inputs[0]) if inputs else 0
        self.header_in: StepHeader | None = None
        self.header_out: StepHeader | None = None
        self.received: dict[int, Incoming] = {}  # posted activation receives, by micro-batch
        self.gradients: dict[int, Incoming] = {}  # posted gradient receives, by micro-batch
        self.posted_activations = self.posted_gradients = 0
        self.kept: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # j -> (input, output or loss)
        self.outputs: list[torch.Tensor] = []
        self.losses: list[torch.Tensor] = []
        self.live = self.peak = 0

    def execute(self, order: list[Action]) -> None:
        if not self.stage.is_first:
            self._receive_header()
        if self.stage.is_last:
            self._split_target()
        for k, (kind, j) in enumerate(order):
            # Post the receives of this action and the next, so data lands while this one computes.
            for ahead_kind, ahead_j in order[k:k + 2]:
                self._post(ahead_kind, ahead_j)
            self.stage.reap_sends()
            self._forward(j) if kind == "F" else self._backward(j)

    # ---- headers and receives --------------------------------------------------------------------

    def _receive_header(self) -> None:
        stage, i = self.stage, self.stage.stage_index
        header = self.header_in = stage.recv_header()
        mine = {"num_stages": stage.num_stages, "n_microbatches": self.m, "training": self.training}
        for field, value in mine.items():
            if getattr(header, field) != value:
                raise ValueError(f"stage {i} has {field}={value} but stage {i - 1} has {field}="
                                 f"{getattr(header, field)}; build every stage's PipelineStage and schedule "
                                 f"alike (training means the schedule has a loss_fn)")
        if header.sender != i - 1:
            raise ValueError(f"stage {i} received a step header from stage {header.sender}, expected stage {i - 1}")
        self.batch_size = header.batch_size

    def _split_target(self) -> None:
        if self.target is None:
            return
        if len(self.target) != self.batch_size:
            raise ValueError(f"stage {self.stage.stage_index}: target has {len(self.target)} rows but the batch "
                             f"stage 0 passed has {self.batch_size}")
        self.targets = list(torch.tensor_split(self.target, self.m))

    def _post(self, kind: str, j: int) -> None:
        stage = self.stage
        if kind == "F" and not stage.is_first:
            while self.posted_activations <= j:  # receives are posted in micro-batch order, as sends are made
                n = self.posted_activations
                self.received[n] = stage.post_activation(self.header_in.activation_shape(n), self.header_in.dtype)
                self.posted_activations += 1
        elif kind == "B" and not stage.is_last and self._gradient_flows(self.header_out):
            while self.posted_gradients <= j:
                n = self.posted_gradients
                self.gradients[n] = stage.post_gradient(self.header_out.activation_shape(n), self.header_out.dtype)
                self.posted_gradients += 1

    def _gradient_flows(self, header: StepHeader | None) -> bool:
        """Whether a gradient comes back for the activations a header describes: only floating ones carry one."""
        return self.training and header is not None and header.dtype.is_floating_point

    # ---- one micro-batch -------------------------------------------------------------------------

    def _computing(self, what: str, j: int) -> contextlib.AbstractContextManager:
        """The timeline's span of micro-batch j's forward or backward computation on this stage."""
        return events.span(f"{what} {j}", events.COMPUTE, stage=self.stage.stage_index, microbatch=j)

    def _forward(self, j: int) -> None:
        stage, i = self.stage, self.stage.stage_index
        x = None
        if stage.is_first:
            with self._computing("forward", j):
                output = self.module(*self.inputs[j])
        else:
            x = stage.take_activation(self.received.pop(j), j)
            if self._gradient_flows(self.header_in):
                x.requires_grad_()  # so that backward yields the gradient to send back
            try:
                with self._computing("forward", j):
                    output = self.module(x)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as exc:  # torch's way to refuse a shape or dtype; other errors pass as they are
                raise ValueError(f"stage {i} could not consume the activation from stage {i - 1} "
                                 f"{describe(x.shape, x.dtype)}: {exc}") from exc
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"stage {i} returned a {type(output).__name__}; only a single tensor can pass "
                            f"between stages and be merged as the output")
        if stage.is_last:
            self.outputs.append(output.detach())
            if self.training:
                loss = self.loss_fn(output, self.targets[j])
                self.losses.append(loss.detach())
                output = loss  # backward starts from the loss
        else:
            self._send_activation(j, output)
        if self.training:
            self.kept[j] = (x, output)
            self.live += 1
        self.peak = max(self.peak, self.live if self.training else 1)

    def _send_activation(self, j: int, output: torch.Tensor) -> None:
        stage, i = self.stage, self.stage.stage_index
        if j == 0:  # micro-batch 0's output describes the step's activations (checked below, then sent)
            check_describable(output, i)
            self.header_out = StepHeader(num_stages=stage.num_stages, sender=i, n_microbatches=self.m,
                                         training=self.training, batch_size=self.batch_size, dtype=output.dtype,
                                         shape=tuple(output.shape))
        expected = self.header_out.activation_shape(j)
        if tuple(output.shape) != expected or output.dtype != self.header_out.dtype:
            rows = microbatch_sizes(self.batch_size, self.m)[j]
            raise ValueError(f"stage {i}: its output for micro-batch {j} ({rows} rows) is "
                             f"{describe(output.shape, output.dtype)}, but expected "
                             f"{describe(expected, self.header_out.dtype)}: an output must keep the micro-batch "
                             f"as dim 0, with the dtype and other dims of micro-batch 0's")
        if j == 0:
            stage.send_header(self.header_out)
        stage.send_activation(output, j)

    def _backward(self, j: int) -> None:
        stage = self.stage
        x, output = self.kept.pop(j)
        if stage.is_last:
            # The unsplit loss is the mean over all B rows, i.e. the sum over micro-batches of
            # (rows_j / B) * (mean over micro-batch j's rows); so each micro-batch's loss gets weight
            # rows_j / B (1/m when B divides evenly), and the gradients add up to the whole batch's.
            if output.requires_grad:
                with self._computing("backward", j):
                    (output * (len(self.targets[j]) / self.batch_size)).backward()
        elif self._gradient_flows(self.header_out):
            gradient = stage.take_gradient(self.gradients.pop(j), j)
            if output.requires_grad:
                with self._computing("backward", j):
                    torch.autograd.backward(output, gradient)
        if x is not None and self._gradient_flows(self.header_in):
            stage.send_gradient(x.grad if x.grad is not None else torch.zeros_like(x))
        self.live -= 1
