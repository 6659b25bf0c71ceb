"""Inputs whose reductions are exact in every dtype and order, the reference result of a reduction
computed locally, and the comparisons collectives are tested with."""

from __future__ import annotations

from typing import Any

import torch


def data(rank: int, numel: int, dtype: torch.dtype, *, seed: int = 0, low: int = 0, high: int = 4) -> torch.Tensor:
    """Small integers in any dtype, so that every summation order gives the same, exact result."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(low, high, (numel,), generator=gen).to(dtype)


_BITWISE = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}


def reference(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    acc = tensors[0].clone()
    for t in tensors[1:]:
        if op in ("SUM", "AVG"):
            acc += t
        elif op == "PRODUCT":
            acc *= t
        elif op in _BITWISE:
            acc = _BITWISE[op](acc, t)
        elif op == "MIN":
            acc = torch.minimum(acc, t)
        else:
            acc = torch.maximum(acc, t)
    if op == "AVG":
        acc = acc / len(tensors) if acc.is_floating_point() else torch.div(acc, len(tensors), rounding_mode="trunc")
    return acc


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{got.shape} vs {want.dtype}"
    assert torch.equal(got, want), f"{what}: first differences {got[got != want][:5]} vs {want[got != want][:5]}"


def same(a: Any, b: Any) -> bool:
    """Whether two results (tensors, in lists, tuples and dicts, or plain values) are equal to the bit, dtype
    and container type included: shoal's and torch's outcome of the same calls."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b
