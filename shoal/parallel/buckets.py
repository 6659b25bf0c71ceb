"""Gradient buckets: which parameters are reduced together, and each bucket's flat buffer.

Parameters are taken in reverse registration order, the order backward usually produces their
gradients, and packed into buckets of one dtype each, about `cap_bytes` large; the first bucket is
smaller so that communication starts early in backward. The assignment depends only on the
parameters' order, sizes and dtypes, so it is the same on every rank.
"""

from __future__ import annotations

import torch


def assign_buckets(params: list[torch.Tensor], cap_bytes: int, first_cap_bytes: int) -> list[list[int]]:
    """Indices into `params`, grouped into buckets, in the order the buckets should be reduced."""
    buckets: list[list[int]] = []
    open_buckets: dict[torch.dtype, tuple[list[int], int]] = {}  # dtype -> (indices, bytes)
    closed_any: set[torch.dtype] = set()
    for index in reversed(range(len(params))):
        param = params[index]
        nbytes = param.numel() * param.element_size()
        members, size = open_buckets.get(param.dtype, ([], 0))
        members.append(index)
        size += nbytes
        limit = cap_bytes if param.dtype in closed_any else first_cap_bytes
        if size >= limit:
            buckets.append(members)
            closed_any.add(param.dtype)
            open_buckets.pop(param.dtype, None)
        else:
            open_buckets[param.dtype] = (members, size)
    buckets.extend(members for members, _ in open_buckets.values())
    return buckets


class Bucket:
    """One bucket: its parameters, which of their gradients are in this step, and a flat buffer for
    them where they must be packed (a communication hook's input, or gradients that are bucket views)."""

    def __init__(self, index: int, params: list[torch.Tensor], names: list[str]) -> None:
        self.index = index
        self.params = params
        self.names = names
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self._buffer: torch.Tensor | None = None
        self.ready = [False] * len(params)
        self.pending = len(params)

    @property
    def buffer(self) -> torch.Tensor:
        """The flat buffer, made on first use: gradients that are reduced where they lie never need one."""
        if self._buffer is None:
            first = self.params[0]
            self._buffer = torch.zeros(self.offsets[-1], dtype=first.dtype, device=first.device)
        return self._buffer

    def view(self, i: int) -> torch.Tensor:
        """Parameter i's slice of the buffer, shaped like the parameter."""
        return self.buffer[self.offsets[i]:self.offsets[i + 1]].view_as(self.params[i])

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`flat` (laid out as the buffer) cut into each parameter's slice, shaped like the parameter."""
        return [flat[start:stop].view_as(p)
                for p, start, stop in zip(self.params, self.offsets[:-1], self.offsets[1:], strict=True)]

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)

    def mark_ready(self, i: int) -> bool:
        """Record that parameter i's gradient is in; True when the whole bucket is."""
        if not self.ready[i]:
            self.ready[i] = True
            self.pending -= 1
        return self.pending == 0
