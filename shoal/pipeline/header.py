"""The step header: what a pipeline stage tells the next one before the first activation of a step, so
that the receiver can allocate every activation of the step (and the gradients it sends back) in advance.

A receive has to be posted with the exact size and dtype of what will arrive, and a middle stage has no
other way to learn the batch size of a step, so the header travels once per step and link. It is a
fixed-length int64 tensor: its size never depends on the step, so it can always be received.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.comm.transport import dtypes

MAX_DIMS = 8
# num_stages, sender, n_microbatches, training, batch_size, dtype code, ndim, then MAX_DIMS dims (zero-padded)
LENGTH = 7 + MAX_DIMS


def microbatch_sizes(batch_size: int, n_microbatches: int) -> list[int]:
    """Rows of each micro-batch, as `torch.tensor_split(batch, n_microbatches)` cuts them: the first
    `batch_size % n_microbatches` get one row more than the rest."""
    base, extra = divmod(batch_size, n_microbatches)
    return [base + 1] * extra + [base] * (n_microbatches - extra)


@dataclass(frozen=True)
class StepHeader:
    """Everything the receiving stage must know about the activations of one step."""

    num_stages: int
    sender: int
    """Stage index of the stage that sends the activations."""
    n_microbatches: int
    training: bool
    """Whether gradients come back this step (the sender's schedule has a loss_fn)."""
    batch_size: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    """Shape of micro-batch 0's activation; micro-batch j's differs only in dim 0, its row count."""

    def activation_shape(self, j: int) -> tuple[int, ...]:
        return (microbatch_sizes(self.batch_size, self.n_microbatches)[j], *self.shape[1:])

    def encode(self) -> torch.Tensor:
        fields = [self.num_stages, self.sender, self.n_microbatches, int(self.training), self.batch_size,
                  dtypes.code(self.dtype, "a pipeline step header"), len(self.shape), *self.shape]
        return torch.tensor(fields + [0] * (LENGTH - len(fields)), dtype=torch.int64)

    @classmethod
    def decode(cls, tensor: torch.Tensor) -> StepHeader:
        fields = tensor.tolist()
        ndim = fields[6]
        return cls(num_stages=fields[0], sender=fields[1], n_microbatches=fields[2], training=bool(fields[3]),
                   batch_size=fields[4], dtype=dtypes.DTYPES[fields[5]], shape=tuple(fields[7:7 + ndim]))


def check_describable(tensor: torch.Tensor, stage: int) -> None:
    """Raise if a header cannot describe `tensor` (the activation stage `stage` is about to send)."""
    dtypes.code(tensor.dtype, f"stage {stage}: its output, sent to the next stage,")
    if not 1 <= tensor.dim() <= MAX_DIMS:
        raise ValueError(f"stage {stage}: its output has shape {tuple(tensor.shape)}; an activation passed between "
                         f"stages needs the batch as dim 0 and at most {MAX_DIMS} dims")
