"""DataParallel: replicas in threads whose gradients equal one module's on the whole batch."""

from __future__ import annotations

import copy
import os
import threading

import pytest
import torch
from torch import nn

from shoal.parallel import DataParallel


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)).double()


def _batch(seed: int, size: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(size, 8, generator=gen, dtype=torch.float64), torch.randint(0, 3, (size,), generator=gen)


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_gradients_equal_one_module_on_the_whole_batch(replicas: int) -> None:
    net = _mlp()
    single = copy.deepcopy(net)
    x, y = _batch(0)  # 10 rows over 3 replicas: pieces of 4, 4 and 2
    x_dp, x_single = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss = nn.functional.cross_entropy(DataParallel(net, replicas=replicas)(x_dp), y)
    loss.backward()
    want = nn.functional.cross_entropy(single(x_single), y)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-13, atol=1e-13)
    for (name, p), q in zip(net.named_parameters(), single.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)
    torch.testing.assert_close(x_dp.grad, x_single.grad, rtol=1e-12, atol=1e-14)


def test_optimizer_steps_track_the_single_module_run() -> None:
    net = _mlp()
    single = copy.deepcopy(net)
    model = DataParallel(net, replicas=3)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, single)]
    for step in range(6):
        x, y = _batch(step, size=12)
        for m, optimizer in zip((model, single), optimizers, strict=True):
            optimizer.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            optimizer.step()
    for (name, p), q in zip(net.named_parameters(), single.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-13, msg=name)


class _TwoHeads(nn.Module):
    """Several inputs (one by keyword), a scale that is not a tensor, and a dict of outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor, scale: float, *, extra: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"sum": scale * self.a(x) + self.b(extra), "labels": self.a(x).argmax(dim=1)}


def test_inputs_keywords_and_dict_outputs_are_split_and_gathered_inside_a_larger_graph() -> None:
    torch.manual_seed(1)
    pre, heads = nn.Linear(8, 8).double(), _TwoHeads().double()
    pre_single, heads_single = copy.deepcopy(pre), copy.deepcopy(heads)
    x, extra = torch.randn(9, 8, dtype=torch.float64), torch.randn(9, 5, dtype=torch.float64)
    got = DataParallel(heads, replicas=2)(pre(x), 0.5, extra=extra)
    want = heads_single(pre_single(x), 0.5, extra=extra)
    assert torch.equal(got["labels"], want["labels"]) and not got["labels"].requires_grad
    (got["sum"] ** 2).sum().backward()
    (want["sum"] ** 2).sum().backward()
    for module, reference in ((pre, pre_single), (heads, heads_single)):
        for p, q in zip(module.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-13)


def test_replicas_run_forward_and_backward_on_threads_of_their_own() -> None:
    forward_threads, backward_threads = set(), set()

    class Recording(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            forward_threads.add(threading.get_ident())
            out = super().forward(x)
            out.register_hook(lambda grad: backward_threads.add(threading.get_ident()))
            return out

    DataParallel(Recording(4, 4), replicas=3)(torch.randn(6, 4)).sum().backward()
    assert len(forward_threads) == 3 and len(backward_threads) == 3


def test_batch_norm_statistics_come_from_the_first_replica_and_eval_needs_no_graph() -> None:
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).double()
    model = DataParallel(net, replicas=2)
    x = torch.randn(8, 4, dtype=torch.float64)
    model(x).sum().backward()
    first_half = copy.deepcopy(net)
    first_half[1].reset_running_stats()
    first_half(x[:4])  # what the first replica's piece does to fresh statistics
    torch.testing.assert_close(net[1].running_mean, first_half[1].running_mean)
    assert net[1].num_batches_tracked.item() == 1  # the other replica's update is its own copy's
    model.eval()
    with torch.no_grad():
        out = model(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, net(x))


class _ReadsThenCounts(nn.Module):
    """Reads a buffer in its forward, then updates it in place, as BatchNorm does its statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(1, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + self.steps
        self.steps += 1
        return out


def test_every_replica_sees_the_buffers_as_they_were_before_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second replica starts late: its buffers must still be the module's from before the first
    replica updated them in place, as torch's replicas get theirs before any runs."""
    import shoal.parallel.data_parallel as data_parallel

    replicate = data_parallel._replicate

    def late_second_replica(*args):
        if threading.current_thread().name.endswith("replica-1"):
            started.wait(5)  # until the first replica has run its forward
        replica = replicate(*args)
        if threading.current_thread().name.endswith("replica-0"):
            replica.register_forward_hook(lambda *_: started.set())
        return replica

    started = threading.Event()
    monkeypatch.setattr(data_parallel, "_replicate", late_second_replica)
    model = DataParallel(_ReadsThenCounts(), replicas=2)
    for step in range(3):
        started.clear()
        out = model(torch.zeros(4, 1, dtype=torch.float64))
        torch.testing.assert_close(out, torch.full((4, 1), float(step), dtype=torch.float64))
    assert model.module.steps.item() == 3  # the first replica's updates, the module's own


def test_batch_norm_in_training_mode_runs_under_inference_mode() -> None:
    torch.manual_seed(3)
    net = nn.BatchNorm1d(4).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    with torch.inference_mode():
        out = DataParallel(net, replicas=2)(x)
    torch.testing.assert_close(out, torch.cat([nn.functional.batch_norm(half, None, None, training=True)
                                               for half in x.chunk(2)]))


def test_a_failing_replica_raises_its_own_error() -> None:
    class Picky(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] < 3:
                raise ArithmeticError(f"piece of {x.shape[0]} rows is too small")
            return x

    with pytest.raises(ArithmeticError, match="piece of 2 rows"):
        DataParallel(Picky(), replicas=3)(torch.randn(8, 2))  # pieces of 3, 3 and 2


def test_mistakes_are_named() -> None:
    with pytest.raises(ValueError, match=r"same number of pieces.*\(8, 2\), \(3, 2\)"):
        DataParallel(nn.Identity(), replicas=4)(torch.randn(8, 2), torch.randn(3, 2))
    with pytest.raises(ValueError, match="replicas must be at least 1, got 0"):
        DataParallel(nn.Identity(), replicas=0)
    with pytest.raises(ValueError, match=r"CPU threads .* device_ids=\[0\]"):
        DataParallel(nn.Identity(), device_ids=[0])


def test_defaults_one_replica_per_usable_core_and_keeps_torch_state_dict_keys() -> None:
    model = DataParallel(nn.Linear(2, 2))
    assert model.replicas == len(os.sched_getaffinity(0))
    assert list(model.state_dict()) == ["module.weight", "module.bias"]


class _Offsets(nn.Module):
    """Parameters whose gradient is the incoming gradient itself (no operator of their own makes a new one)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
        self.w = nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x ** 2).mean(dim=1) + self.a + self.w.sum()


def test_gradients_that_alias_the_incoming_gradient_are_summed_into_new_memory() -> None:
    net = _Offsets()
    single = copy.deepcopy(net)
    x = torch.randn(8, 3, dtype=torch.float64)
    DataParallel(net, replicas=2)(x).sum().backward()
    single(x).sum().backward()
    torch.testing.assert_close(net.a.grad, single.a.grad)  # 8.0: one per row, not a replica's count twice
    torch.testing.assert_close(net.w.grad, single.w.grad)


def test_a_second_backward_through_kept_graphs_and_double_backward_is_refused() -> None:
    net = _mlp()
    single = copy.deepcopy(net)
    x, _ = _batch(3)
    out, want = DataParallel(net, replicas=2)(x), single(x)
    out.sum().backward(retain_graph=True)
    (out ** 2).sum().backward()
    want.sum().backward(retain_graph=True)
    (want ** 2).sum().backward()
    for p, q in zip(net.parameters(), single.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-13)
    x = x.clone().requires_grad_()
    grad, = torch.autograd.grad(DataParallel(net, replicas=2)(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"once_differentiable|does not require grad"):
        grad.sum().backward()


def test_outputs_that_need_no_gradient_do_not_claim_one() -> None:
    class Detached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.lin(x)
            return y, y.detach() * 2

    y, detached = DataParallel(Detached(), replicas=2)(torch.randn(4, 2))
    assert y.requires_grad and not detached.requires_grad
