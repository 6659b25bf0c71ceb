"""Communication hooks: how DistributedDataParallel averages one bucket of gradients over ranks.

A hook is `hook(state, bucket) -> handle`, where `bucket` is a `GradBucket` and `handle.wait()`
returns the bucket's averaged flat gradient. `state` is what `register_comm_hook` was given; the
built-in hooks take the process group there (None: DDP's own group).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.api import all_reduce, get_world_size
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.backends.work import Work
from shoal.parallel.buckets import Bucket


class GradBucket:
    """One bucket's gradients as a hook sees them, read through torch's GradBucket methods, so that a hook
    written for torch's DDP reads it unchanged. `group` (shoal's own) is the DDP's process group, for hooks
    whose state names none."""

    def __init__(self, bucket: Bucket, buffer: torch.Tensor, group: ProcessGroup, *, last: bool) -> None:
        self._bucket, self._buffer, self._last = bucket, buffer, last
        self.group = group

    def index(self) -> int:
        """The bucket's place in the order every rank reduces in: 0 first."""
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The gradients, flat: reduce it in place or answer a new tensor."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace what `buffer()` answers (torch's compress wrappers hand the hook they wrap a narrower copy)."""
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's slice of `buffer()`, shaped as the parameter: writing one writes the buffer."""
        return self._bucket.split(self._buffer)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        """Whether this is the last bucket of the backward pass (its highest index)."""
        return self._last


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
    return Pending(group.all_reduce(bucket.buffer(), ReduceOp.AVG), bucket.buffer)


def _divide_then_sum(tensor: torch.Tensor, group: ProcessGroup, *, synchronize_device: bool = False) -> Work:
    """Start averaging `tensor` over `group` in place as torch's hooks and averagers do: divide it by the
    group's size, then all-reduce the SUM; returns the all-reduce's Work. Dividing first keeps a
    half-precision sum from overflowing where the mean would not. `synchronize_device` waits for the
    accelerator between the two, as torch's average_parameters does, so that the all-reduce cannot
    overlap work another process group has in flight (a CPU tensor needs no such wait)."""
    tensor.div_(get_world_size(group))
    if synchronize_device and tensor.device.type != "cpu" and torch.accelerator.is_available():
        torch.accelerator.synchronize()
    work = all_reduce(tensor, ReduceOp.SUM, group=group, async_op=True)
    if work is None:  # all_reduce warned and did nothing: `group` is GroupMember.NON_GROUP_MEMBER
        raise ValueError("cannot average over a group this rank is not a member of (GroupMember.NON_GROUP_MEMBER)")
    return work


def _compressed(dtype: torch.dtype) -> Callable[[ProcessGroup | None, GradBucket], Pending]:
    def hook(state: ProcessGroup | None, bucket: GradBucket) -> Pending:
        # Cast, then divide in `dtype`, as torch's compress hooks do: the same rounding, so the same sums (and
        # a gradient beyond float16's range overflows in the cast, in torch's as here).
        packed = bucket.buffer().to(dtype)
        work = _divide_then_sum(packed, state or bucket.group)
        return Pending(work, lambda: bucket.buffer().copy_(packed))
    return hook


fp16_compress_hook = _compressed(torch.float16)
fp16_compress_hook.__doc__ = "Send gradients as float16: half the bytes, about 3 significant digits."
bf16_compress_hook = _compressed(torch.bfloat16)
bf16_compress_hook.__doc__ = "Send gradients as bfloat16: half the bytes, float32's range, about 2 digits."


_Hook = Callable[[Any, GradBucket], Any]  # answers something whose wait() gives the averaged flat gradient


class _CastBack:
    """A wrapped hook's reduction in flight: `wait()` writes its answer, reduced in a narrower dtype, back into
    the bucket's own buffer."""

    def __init__(self, pending: Any, into: torch.Tensor) -> None:
        self._pending, self._into = pending, into

    def wait(self) -> torch.Tensor:
        return self._into.copy_(self._pending.wait())


def _compress_wrapper(dtype: torch.dtype) -> Callable[[_Hook], _Hook]:
    def wrap(hook: _Hook) -> _Hook:
        def compressed_hook(state: Any, bucket: GradBucket) -> _CastBack:
            narrow = GradBucket(bucket._bucket, bucket.buffer().to(dtype), bucket.group, last=bucket.is_last())
            return _CastBack(hook(state, narrow), bucket.buffer())
        return compressed_hook
    return wrap


fp16_compress_wrapper = _compress_wrapper(torch.float16)
fp16_compress_wrapper.__doc__ = """`hook` given the bucket as float16 and its answer cast back, torch's wrapper:
`fp16_compress_wrapper(powerSGD_hook)` sends PowerSGD's factors in half the bytes."""
bf16_compress_wrapper = _compress_wrapper(torch.bfloat16)
bf16_compress_wrapper.__doc__ = """`hook` given the bucket as bfloat16 and its answer cast back, torch's
wrapper: float32's range in half the bytes, about 2 significant digits."""
