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
    """One bucket: a flat buffer holding its parameters' gradients, and which are in this step."""

    def __init__(self, index: int, params: list[torch.Tensor], names: list[str]) -> None:
        self.index = index
        self.params = params
        self.names = names
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.buffer = torch.zeros(self.offsets[-1], dtype=params[0].dtype, device=params[0].device)
        self.ready = [False] * len(params)
        self.pending = len(params)

    def view(self, i: int) -> torch.Tensor:
        """Parameter i's slice of the buffer, shaped like the parameter."""
        return self.buffer[self.offsets[i]:self.offsets[i + 1]].view_as(self.params[i])

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)

    def mark_ready(self, i: int) -> bool:
        """Record that parameter i's gradient is in; True when the whole bucket is."""
        if not self.ready[i]:
            self.ready[i] = True
            self.pending -= 1
        return self.pending == 0
