"""Backward in halves (zero-bubble schedules): for graphs that make the split hard, the input half's
gradients and, after the weight half, every weight's .grad equal one full torch.autograd.backward."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from shoal.pipeline.split_backward import backward_input


class Residual(nn.Module):
    """A residual block, a weight used twice, two outputs made by one node (chunk), an input passed on."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8)
        self.tied = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + torch.tanh(self.a(self.norm(x)))
        h = h + self.b(h) * y
        h = h @ self.tied + (h @ self.tied).relu()
        p, q = h.chunk(2, dim=1)
        return p * 2, q + x[:, :4]


class Sandwich(nn.Module):
    """One layer used twice with another between: l(m(l(x)))."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.m = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.l(torch.tanh(self.m(self.l(x)))) * y,)


class PassesOn(nn.Module):
    """Outputs that feed each other: a value returned and also used for another output (as `pipeline()`
    makes a stage that hands a residual on), the same tensor returned twice, and a learned table added
    to the input and handed on."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = nn.Linear(8, 8), nn.Linear(8, 8)
        self.table = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        skip = self.emb(x)
        h = self.lin(skip) + skip
        return h, skip, h, x * y + self.table, self.table


def _inputs(first: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(5, 8, generator=gen, dtype=torch.float64).requires_grad_(not first),
            torch.randn(5, 8, generator=gen, dtype=torch.float64)]


def _compare(model: nn.Module, run: Callable, first: bool, loss: bool) -> None:
    """Full backward, then the two halves, from the same outputs' gradients."""
    torch.manual_seed(0)
    model = model.double()
    weights = list(model.parameters())
    results = []
    for halves in (False, True):
        model.zero_grad()
        inputs = _inputs(first)
        outputs = list(run(model, *inputs))
        if loss:
            outputs = [sum((o.double() ** 2).mean() for o in outputs)]
            grads = [None]
        else:
            gen = torch.Generator().manual_seed(4)
            grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outputs]
        if halves:
            found, weight_half = backward_input(outputs, grads, inputs, weights)
            assert all(p.grad is None for p in weights)  # nothing of the weights' part has run yet
            weight_half()
        else:
            torch.autograd.backward(outputs, [g if g is not None else torch.ones_like(o) for o, g in
                                              zip(outputs, grads, strict=True)])
            found = [x.grad for x in inputs]
        results.append((found, [p.grad for p in weights]))
    (full_inputs, full_weights), (half_inputs, half_weights) = results
    for want, got in zip(full_inputs + full_weights, half_inputs + half_weights, strict=True):
        assert (want is None) == (got is None)
        if want is not None:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("model", [Residual, Sandwich, PassesOn])
@pytest.mark.parametrize(("first", "loss"), [(False, False), (True, False), (False, True)],
                         ids=["middle stage", "first stage", "last stage"])
def test_the_two_halves_give_the_full_backward(model: type[nn.Module], first: bool, loss: bool) -> None:
    _compare(model(), lambda m, x, y: m(x, y), first, loss)


def test_no_outputs_that_need_gradients_give_no_gradients() -> None:
    found, weight_half = backward_input([], [], _inputs(False), list(nn.Linear(8, 8).parameters()))
    weight_half()
    assert found == [None, None]
