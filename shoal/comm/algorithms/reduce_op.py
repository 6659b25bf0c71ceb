"""Reduction operators for collectives, applied in place with torch ops on whole tensors."""

from __future__ import annotations

import enum

import torch


class ReduceOp(enum.IntEnum):
    """Same names as `torch.distributed.ReduceOp`."""

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5  # the bitwise ones take integer and bool tensors only, as torch's gloo does
    BOR = 6
    BXOR = 7


# Each operator as an elementwise torch function (AVG sums; `finish_` divides once at the end).
_ELEMENTWISE = {ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PRODUCT: torch.mul,
                ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum, ReduceOp.BAND: torch.bitwise_and,
                ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor}


def combine_(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> None:
    """acc <- acc (op) other, elementwise and in place."""
    _ELEMENTWISE[op](acc, other, out=acc)


def reduce_into(out: torch.Tensor, parts: list[torch.Tensor], op: ReduceOp) -> None:
    """out <- parts[0] (op) parts[1] (op) ..., in that order (AVG sums); one pass for the first two."""
    _ELEMENTWISE[op](parts[0], parts[1], out=out)
    for part in parts[2:]:
        combine_(out, part, op)


def finish_(acc: torch.Tensor, op: ReduceOp, world_size: int) -> None:
    """Turn a sum into a mean for AVG; integers round toward zero, as NCCL's integer AVG does."""
    finish_into(acc, acc, op, world_size)


def finish_into(out: torch.Tensor, acc: torch.Tensor, op: ReduceOp, world_size: int) -> None:
    """out <- what `finish_` makes of acc, in one pass over memory where out is another tensor (a copy
    and a division fused); acc is left as it is unless it is out."""
    if op != ReduceOp.AVG or world_size == 1:
        if out is not acc:
            out.copy_(acc)
    elif acc.is_floating_point() or acc.is_complex():
        torch.div(acc, world_size, out=out)
    else:
        torch.div(acc, world_size, rounding_mode="trunc", out=out)
