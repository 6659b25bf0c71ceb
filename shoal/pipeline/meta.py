"""The metadata of one micro-batch's activations: what a stage sends the next one just before them, so
that the receiver can post receives of the right sizes and dtypes.

A receive has to be posted with the exact size and dtype of what will arrive, and a stage has no other
way to learn what its neighbour's module returns for this micro-batch (the batch size can change from
step to step, a split can be uneven, a chunk spec can cut along any dim). So the metadata travels with
every micro-batch. It is a fixed-length int64 tensor: its size never depends on the step, so it can
always be received. It also carries what both stages must agree on, so a mismatch is named, not hung on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.comm.transport import dtypes

MAX_TENSORS = 8
MAX_DIMS = 8
_FIXED = 6  # num_stages, sender, n_microbatches, training, microbatch, count
_PER_TENSOR = 2 + MAX_DIMS  # dtype code, ndim, dims (zero-padded)
LENGTH = _FIXED + MAX_TENSORS * _PER_TENSOR


def describe(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> str:
    return f"of shape {tuple(shape)} dtype {str(dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class ActivationMeta:
    """The shapes and dtypes of the tensors one stage passes the next for one micro-batch."""

    num_stages: int
    sender: int
    """Stage index of the stage that sends the activations."""
    n_microbatches: int
    training: bool
    """Whether gradients come back this step (the schedule runs backward)."""
    microbatch: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    def describe(self) -> str:
        return ", ".join(describe(shape, dtype) for shape, dtype in zip(self.shapes, self.dtypes, strict=True))

    def encode(self) -> torch.Tensor:
        fields = [self.num_stages, self.sender, self.n_microbatches, int(self.training), self.microbatch,
                  len(self.shapes)]
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            fields += [dtypes.code(dtype, "a pipeline activation"), len(shape), *shape, *[0] * (MAX_DIMS - len(shape))]
        return torch.tensor(fields + [0] * (LENGTH - len(fields)), dtype=torch.int64)

    @classmethod
    def decode(cls, tensor: torch.Tensor) -> ActivationMeta:
        fields = tensor.tolist()
        shapes, kinds = [], []
        for k in range(fields[5]):
            start = _FIXED + k * _PER_TENSOR
            kinds.append(dtypes.DTYPES[fields[start]])
            shapes.append(tuple(fields[start + 2:start + 2 + fields[start + 1]]))
        return cls(num_stages=fields[0], sender=fields[1], n_microbatches=fields[2], training=bool(fields[3]),
                   microbatch=fields[4], shapes=tuple(shapes), dtypes=tuple(kinds))


def check_sendable(tensors: tuple, stage: int) -> None:
    """Raise if metadata cannot describe `tensors`, the outputs stage `stage` is about to send on."""
    if not 1 <= len(tensors) <= MAX_TENSORS or not all(isinstance(t, torch.Tensor) for t in tensors):
        kinds = [type(t).__name__ for t in tensors]
        raise TypeError(f"stage {stage} returned {kinds}; a stage passes the next one a tensor or a tuple of 1 to "
                        f"{MAX_TENSORS} tensors")
    for tensor in tensors:
        dtypes.code(tensor.dtype, f"stage {stage}: its output, sent to the next stage,")
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"stage {stage}: an output has shape {tuple(tensor.shape)}; an activation passed between "
                             f"stages has at most {MAX_DIMS} dims")
