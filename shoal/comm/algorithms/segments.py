"""Several flat tensors of one dtype seen as one sequence, their concatenation, so that an all-reduce can
work on tensors where they lie (a DDP bucket's gradients) instead of packing them into one buffer first
and unpacking the result after: two passes over memory saved where the algorithm copies anyway."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence

import torch


class Segments:
    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        """`tensors`: flat, contiguous, of one dtype and device; at least one."""
        self.tensors = list(tensors)
        self.starts = [0]
        for t in self.tensors:
            self.starts.append(self.starts[-1] + t.numel())
        self.numel = self.starts.pop()
        self.dtype = self.tensors[0].dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.tensors[0].element_size()

    def pieces(self, start: int, stop: int) -> list[tuple[int, torch.Tensor]]:
        """The parts of elements [start, stop) of the concatenation, each as (where it starts in the
        concatenation, a view of the tensor that holds it), in order; empty tensors are left out."""
        found = []
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while start < stop:
            tensor, base = self.tensors[i], self.starts[i]
            end = min(stop, base + tensor.numel())
            if end > start:
                found.append((start, tensor[start - base:end - base]))
                start = end
            i += 1
        return found

    def disjoint(self) -> bool:
        """Whether no two of the tensors share memory."""
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in self.tensors if t.numel())
        return all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))

    def packed(self, memory: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """The concatenation as one tensor: the only tensor itself, or a copy in `memory(nbytes)` (bytes)."""
        if len(self.tensors) == 1:
            return self.tensors[0]
        return torch.cat(self.tensors, out=memory(self.nbytes).view(self.dtype))

    def unpack(self, flat: torch.Tensor) -> None:
        """Copy a packed concatenation's elements back where they belong (nothing to do if it is ours)."""
        if flat is not self.tensors[0]:
            for start, tensor in zip(self.starts, self.tensors, strict=True):
                tensor.copy_(flat[start:start + tensor.numel()])
