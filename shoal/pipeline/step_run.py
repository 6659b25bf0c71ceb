"""One step of a schedule on one rank: its stages' micro-batches, posted receives, what backward still
needs, and the hand-over between two stages that run on this same rank.

Receives are posted for the action running and the next one, so data lands while this one computes. A
stage that follows another on this rank takes its activations (and gives back its gradients) directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from shoal.observe import events
from shoal.pipeline.meta import ActivationMeta, check_sendable, describe
from shoal.pipeline.orders import Action
from shoal.pipeline.split_backward import backward_input
from shoal.pipeline.stage import Incoming, PipelineStage


class StepRun:
    """The state of one step over this rank's stages (by stage index)."""

    def __init__(self, stages: dict[int, PipelineStage], m: int, training: bool, loss_fn: Callable | None,
                 arg_mbs: list[tuple], kwarg_mbs: list[dict], target_mbs: list | None,
                 loss_kwargs: dict[str, Any] | None, keep_outputs: bool) -> None:
        self.stages, self.m, self.training = stages, m, training
        self.loss_fn, self.loss_kwargs = loss_fn, loss_kwargs or {}
        self.arg_mbs, self.kwarg_mbs, self.target_mbs = arg_mbs, kwarg_mbs, target_mbs
        self.keep_outputs = keep_outputs
        self.metas: dict[tuple[int, int], Incoming] = {}  # posted metadata receives, by (stage, j)
        self.meta_out: dict[tuple[int, int], ActivationMeta] = {}
        self.gradients: dict[tuple[int, int], Incoming] = {}  # posted gradient receives
        # What one stage hands the next (or, backward, the previous) on this rank, by receiving (stage, j).
        self.handed_activations: dict[tuple[int, int], tuple[ActivationMeta, tuple]] = {}
        self.handed_gradients: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.kept: dict[tuple[int, int], tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
        self.weight_halves: dict[tuple[int, int], Callable[[], None]] = {}  # by (stage, j), after an "I"
        self.outputs: dict[int, Any] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.peak = 0

    def execute(self, order: list[Action], *, lookahead: bool) -> None:
        """Run `order`; with `lookahead`, the receives of the next action are posted before this one runs."""
        for k, (kind, s, j) in enumerate(order):
            for ahead in order[k:k + (2 if lookahead else 1)]:
                self._post(*ahead)
            for stage in self.stages.values():
                stage.reap_sends()
            if kind == "F":
                self._forward(s, j)
            elif kind == "W":
                self._backward_weight(s, j)
            else:
                self._backward(kind, s, j)
            self.peak = max(self.peak, len(self.kept) if self.training else 1)
        for stage in self.stages.values():
            stage.finish_sends()

    def _post(self, kind: str, s: int, j: int) -> None:
        stage = self.stages[s]
        if kind == "F" and not stage.is_first and not stage.is_local(s - 1) and (s, j) not in self.metas:
            self.metas[(s, j)] = stage.post_meta(j)
        elif kind in ("B", "I") and not stage.is_last and not stage.is_local(s + 1) and (s, j) not in self.gradients:
            meta = self.meta_out.get((s, j))
            if meta is not None and meta.training:
                self.gradients[(s, j)] = stage.post_gradients(meta)

    def _computing(self, what: str, s: int, j: int) -> contextlib.AbstractContextManager:
        """The timeline's span of micro-batch j's forward or backward computation on stage s."""
        return events.span(f"{what} {j}", events.COMPUTE, stage=s, microbatch=j)

    # ---- forward -------------------------------------------------------------------------------

    def _receive(self, stage: PipelineStage, j: int) -> list[torch.Tensor]:
        s = stage.stage_index
        if stage.is_local(s - 1):
            meta, tensors = self.handed_activations.pop((s, j))
            tensors = [t.detach() for t in tensors]
        else:
            meta = stage.take_meta(self.metas.pop((s, j)), j)
            self._check_meta(stage, meta, j)
            tensors = stage.take_activations(stage.post_activations(meta), meta)
        stage.check_declared("input_args", tuple(meta.shapes), tuple(meta.dtypes))
        if self.training:
            for tensor in tensors:
                if tensor.dtype.is_floating_point:
                    tensor.requires_grad_()  # so that backward yields the gradient to send back
        return tensors

    def _check_meta(self, stage: PipelineStage, meta: ActivationMeta, j: int) -> None:
        s = stage.stage_index
        mine = {"num_stages": stage.num_stages, "n_microbatches": self.m, "training": self.training}
        for field, value in mine.items():
            if getattr(meta, field) != value:
                raise ValueError(f"stage {s} has {field}={value} but stage {s - 1} has {field}={getattr(meta, field)}; "
                                 f"build every stage's PipelineStage and schedule alike (training means the "
                                 f"schedule runs backward: it has a loss_fn and step, not eval, was called)")
        if (meta.sender, meta.microbatch) != (s - 1, j):
            raise ValueError(f"stage {s} expected micro-batch {j} from stage {s - 1} but received micro-batch "
                             f"{meta.microbatch} from stage {meta.sender}")

    def _forward(self, s: int, j: int) -> None:
        stage = self.stages[s]
        kwargs = self.kwarg_mbs[j] if self.kwarg_mbs else {}
        if stage.is_first:
            inputs, args = [], self.arg_mbs[j]
        else:
            inputs = args = self._receive(stage, j)
        try:
            with self._computing("forward", s, j):
                output = stage.submod(*args, **kwargs)
        except RuntimeError as exc:  # torch's way to refuse a shape or dtype; other errors pass as they are
            if stage.is_first or type(exc) is not RuntimeError:  # out of memory, NotImplementedError, ...
                raise
            got = ", ".join(describe(t.shape, t.dtype) for t in inputs)
            raise ValueError(f"stage {s} could not consume the activations from stage {s - 1} ({got}): "
                             f"{exc}") from exc
        outputs = tuple(output) if isinstance(output, tuple | list) else (output,)
        if stage.is_last:
            if self.keep_outputs:
                self.outputs[j] = _detached(output)
            if self.loss_fn is not None and self.target_mbs is not None:
                loss = self.loss_fn(output, self.target_mbs[j], **self.loss_kwargs)
                self.losses[j] = loss.detach()
                outputs = (loss,)  # backward starts from the loss
        else:
            self._send(stage, j, outputs)
        if self.training:
            self.kept[(s, j)] = (inputs, outputs)

    def _send(self, stage: PipelineStage, j: int, outputs: tuple) -> None:
        s = stage.stage_index
        check_sendable(outputs, s)
        meta = ActivationMeta(num_stages=stage.num_stages, sender=s, n_microbatches=self.m, training=self.training,
                              microbatch=j, shapes=tuple(tuple(t.shape) for t in outputs),
                              dtypes=tuple(t.dtype for t in outputs))
        stage.check_declared("output_args", meta.shapes, meta.dtypes)
        self.meta_out[(s, j)] = meta
        if stage.is_local(s + 1):
            self.handed_activations[(s + 1, j)] = (meta, outputs)
        else:
            stage.send_activations(meta, outputs)

    # ---- backward ------------------------------------------------------------------------------

    def _backward(self, kind: str, s: int, j: int) -> None:
        """A full backward ("B"), or its input half ("I"), whose weight half ("W") runs later."""
        stage = self.stages[s]
        inputs, outputs = self.kept.pop((s, j))
        if stage.is_last:
            roots, grads = [outputs[0]], [None]  # the loss (step() made sure there is a target)
        else:
            roots = [t for t in outputs if t.dtype.is_floating_point]
            if stage.is_local(s + 1):
                grads = self.handed_gradients.pop((s, j))
            else:
                grads = stage.take_gradients(self.gradients.pop((s, j)), self.meta_out[(s, j)])
        pairs = [(root, grad) for root, grad in zip(roots, grads, strict=True) if root.requires_grad]
        roots, grads = [root for root, _ in pairs], [grad for _, grad in pairs]
        if kind == "I" and stage.dw_builder is None:
            with self._computing("backward input", s, j):
                found, weights = backward_input(roots, grads, inputs, list(stage.submod.parameters()))
            self.weight_halves[(s, j)] = weights
        else:
            if roots:
                with self._computing("backward", s, j):
                    torch.autograd.backward(roots, grads)
            found = [x.grad for x in inputs]
            if stage.dw_builder is not None:  # torch's contract: the builder's runner computes the weights' part
                runner = stage.dw_builder()
                if kind == "I":
                    self.weight_halves[(s, j)] = runner
                else:
                    runner()
        if not stage.is_first:
            self._send_back(stage, s, j, inputs, found)

    def _backward_weight(self, s: int, j: int) -> None:
        with self._computing("backward weight", s, j):
            self.weight_halves.pop((s, j))()

    def _send_back(self, stage: PipelineStage, s: int, j: int, inputs: list[torch.Tensor],
                   found: list[torch.Tensor | None]) -> None:
        gradients = [(grad if grad is not None else torch.zeros_like(x)) if x.dtype.is_floating_point else None
                     for x, grad in zip(inputs, found, strict=True)]
        if stage.is_local(s - 1):
            self.handed_gradients[(s - 1, j)] = [g for g in gradients if g is not None]
        else:
            stage.send_gradients(j, gradients)


def _detached(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, tuple | list):
        return type(output)(_detached(o) for o in output)
    return output
