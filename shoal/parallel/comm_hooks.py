"""Communication hooks: how DistributedDataParallel averages one bucket of gradients over ranks.

A hook is `hook(state, bucket) -> handle`, where `bucket` is a `GradBucket` and `handle.wait()`
returns the bucket's averaged flat gradient. `state` is what `register_comm_hook` was given; the
built-in hooks take the process group there (None: DDP's own group).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.backends.work import Work


@dataclass
class GradBucket:
    index: int
    buffer: torch.Tensor  # the bucket's gradients, flat; reduce it in place or return a new tensor
    group: ProcessGroup  # the DDP's group, for hooks whose state names none


class Pending:
    """A bucket reduction in flight: `wait()` returns the averaged gradient."""

    def __init__(self, work: Work, result: Callable[[], torch.Tensor]) -> None:
        self._work, self._result = work, result

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._result()


def allreduce_hook(state: ProcessGroup | None, bucket: GradBucket) -> Pending:
    """The default: average the bucket in place with one all-reduce."""
    group = state or bucket.group
    return Pending(group.all_reduce(bucket.buffer, ReduceOp.AVG), lambda: bucket.buffer)


def _compressed(dtype: torch.dtype) -> Callable[[ProcessGroup | None, GradBucket], Pending]:
    def hook(state: ProcessGroup | None, bucket: GradBucket) -> Pending:
        group = state or bucket.group
        # Divide before the sum so that the half-precision sum cannot overflow where the mean would not.
        packed = bucket.buffer.div(group.size).to(dtype)
        work = group.all_reduce(packed, ReduceOp.SUM)
        return Pending(work, lambda: bucket.buffer.copy_(packed))
    return hook


fp16_compress_hook = _compressed(torch.float16)
fp16_compress_hook.__doc__ = "Send gradients as float16: half the bytes, about 3 significant digits."
bf16_compress_hook = _compressed(torch.bfloat16)
bf16_compress_hook.__doc__ = "Send gradients as bfloat16: half the bytes, float32's range, about 2 digits."
