"""PowerSGD against torch's: shoal's hook on a "shoal" group and torch's on a gloo group, given the same buckets
of gradients step after step on real ranks, answer the same averages (their memories, error feedback and
warm-started Qs, evolving alike); DDP trains with it as DDP with torch's hook does; what it keeps between
steps travels to a new generation's members through its state dict. Bad arguments raise as torch's do."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from shoal.parallel.buckets import Bucket
from shoal.parallel.comm_hooks import GradBucket
from tests.ranks import run_ranks

STEPS, START = 6, 2
# Three buckets: two matrices of one shape, a vector; a matrix, a vector, one too thin to gain; vectors only.
LAYOUT = [[(24, 16), (24,), (16, 16), (16, 16)], [(8, 16), (8,), (3, 1)], [(5,), (7,)]]


def _buckets(rank: int) -> list[list[list[torch.Tensor]]]:
    """Per step, each bucket's gradients: each rank its own, so that averaging them matters."""
    gen = torch.Generator().manual_seed(10 + rank)
    return [[[torch.randn(s, generator=gen) for s in shapes] for shapes in LAYOUT] for _ in range(STEPS)]


def _averages(state: Any, hook: Any, group: Any, steps: list[list[list[torch.Tensor]]], *, in_flight: bool
              ) -> list[torch.Tensor]:
    """Run each step's buckets through `hook` in DDP's order and keep the answers: all started, then awaited
    in order, as shoal's DDP does (`in_flight`), or each awaited before the next begins. torch's hook needs
    the latter: it starts its later all-reduces from its futures' callbacks, which could otherwise pair one
    rank's bucket 0 with another's bucket 1 on gloo."""
    layout = [Bucket(i, [torch.empty(s) for s in shapes], [f"{i}.{j}" for j in range(len(shapes))])
              for i, shapes in enumerate(LAYOUT)]
    out = []
    for grads in steps:
        pending = []
        for bucket, tensors in zip(layout, grads, strict=True):
            flat = torch.cat([g.reshape(-1) for g in tensors])
            pending.append(hook(state, GradBucket(bucket, flat, group, last=bucket.index == len(layout) - 1)))
            if not in_flight:
                out.append(pending.pop().wait().clone())
        out.extend(p.wait().clone() for p in pending)
    return out


@contextmanager
def _torch_group(rank: int, world: int, port: int, backend: str = "gloo") -> Iterator[None]:
    """torch's default group on `backend` for the block; every rank past its last callback before it goes:
    torch's hook keeps the group in its futures' callbacks, and a gloo worker that drops the last reference
    destroys the group on that very thread, which cannot join itself (std::system_error, abort)."""
    import torch.distributed as torch_dist

    import shoal  # noqa: F401 - registers backend "shoal"

    torch_dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
        torch_dist.barrier()
    finally:
        torch_dist.destroy_process_group()


def _hooks(rank: int, world: int, torch_port: int, options: dict[str, Any], wrapper: str | None = None
           ) -> dict[str, Any]:
    """Each library's powerSGD_hook (in each one's `wrapper`, if named) on the same buckets."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    import shoal.parallel
    from shoal.comm.api import group as shoal_group
    from shoal.parallel import PowerSGDState, powerSGD_hook

    def wrapped(library: Any, hook: Any) -> Any:
        return hook if wrapper is None else getattr(library, wrapper)(hook)

    steps, out = _buckets(rank), {}
    state = PowerSGDState(process_group=None, start_powerSGD_iter=START, **options)
    out["shoal"] = _averages(state, wrapped(shoal.parallel, powerSGD_hook), shoal_group.WORLD, steps, in_flight=True)
    out["shoal stats"], out["shoal iter"] = state.compression_stats(), state.iter
    with _torch_group(rank, world, torch_port):
        state = torch_powersgd.PowerSGDState(process_group=None, start_powerSGD_iter=START, **options)
        out["torch"] = _averages(state, wrapped(default_hooks, torch_powersgd.powerSGD_hook), None, steps,
                                 in_flight=False)
        out["torch stats"], out["torch iter"] = state.compression_stats(), state.iter
    return out


@pytest.mark.parametrize(("world", "options"), [
    (2, {"matrix_approximation_rank": 1}),
    (2, {"matrix_approximation_rank": 4, "batch_tensors_with_same_shape": True}),  # QR, and a stacked batch
    (3, {"matrix_approximation_rank": 2, "warm_start": False, "orthogonalization_epsilon": 1e-8}),
    (2, {"matrix_approximation_rank": 2, "use_error_feedback": False, "min_compression_rate": 1}),
])
def test_powersgd_averages_each_bucket_as_torch_s_hook_does(world: int, options: dict[str, Any]) -> None:
    from shoal.ports import free_port

    out = run_ranks(_hooks, world, free_port(), options, timeout=90)
    for rank in range(world):
        assert out[rank]["shoal iter"] == out[rank]["torch iter"] == STEPS
        assert out[rank]["shoal stats"] == out[rank]["torch stats"]
        assert out[rank]["shoal stats"][0] > 1  # it did compress
        for i, (mine, theirs) in enumerate(zip(out[rank]["shoal"], out[rank]["torch"], strict=True)):
            # float32 sums of three ranks in gloo's order and shoal's: a few units in the last place apart
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, r=rank, i=i: f"rank {r}, step {i // 3} bucket {i % 3}: {m}")
        # Every replica gets the same average; once compressed, it is not the exact mean.
        torch.testing.assert_close(out[rank]["shoal"], out[0]["shoal"], rtol=0, atol=0)
    exact = torch.cat([sum(_buckets(r)[START][0][j] for r in range(world)).reshape(-1) / world for j in range(4)])
    assert not torch.allclose(out[0]["shoal"][len(LAYOUT) * START], exact, atol=1e-3)


@pytest.mark.parametrize("wrapper", ["fp16_compress_wrapper", "bf16_compress_wrapper"])
def test_a_compress_wrapper_sends_powersgd_narrower_as_torch_s_does(wrapper: str) -> None:
    from shoal.ports import free_port

    out = run_ranks(_hooks, 2, free_port(), {"matrix_approximation_rank": 2}, wrapper, timeout=90)
    for rank in range(2):
        assert out[rank]["shoal stats"] == out[rank]["torch stats"]
        for i, (mine, theirs) in enumerate(zip(out[rank]["shoal"], out[rank]["torch"], strict=True)):
            assert mine.dtype == torch.float32, mine.dtype  # cast back into the bucket (torch's DDP casts)
            torch.testing.assert_close(mine, theirs.float(), rtol=0, atol=0,
                                       msg=lambda m, r=rank, i=i: f"rank {r}, step {i // 3} bucket {i % 3}: {m}")


def _batched(rank: int, world: int, options: dict[str, Any]) -> tuple[list[torch.Tensor], tuple]:
    from shoal.comm.api import group as shoal_group
    from shoal.parallel import PowerSGDState, batched_powerSGD_hook

    state = PowerSGDState(process_group=None, start_powerSGD_iter=START, **options)
    averages = _averages(state, batched_powerSGD_hook, shoal_group.WORLD, _buckets(rank), in_flight=True)
    return averages, state.compression_stats()


def _batched_reference(world: int, matrix_approximation_rank: int, use_error_feedback: bool = True,
                       warm_start: bool = True) -> list[torch.Tensor]:
    """Batched PowerSGD worked out in one process from every rank's buckets: each bucket's flat gradients,
    padded with zeros to a square, approximated as P Q^T by one power iteration from the last step's Q, what
    it misses carried to each rank's next step. (torch 2.13's own batched hook fails before it computes:
    it hands its orthogonalization a 2-D Q where that asserts a batch, so it cannot be the reference.)"""
    inputs = [_buckets(r) for r in range(world)]
    seeds = np.random.RandomState(0)  # torch's and shoal's draws of fresh Qs
    errors: dict[tuple[int, int], torch.Tensor] = {}
    qs: dict[int, torch.Tensor] = {}
    out = []
    for step in range(STEPS):
        for b in range(len(LAYOUT)):
            flats = [torch.cat([g.reshape(-1) for g in inputs[r][step][b]]) for r in range(world)]
            if step < START:
                out.append(sum(flats) / world)
                continue
            n = flats[0].numel()
            side = math.ceil(math.sqrt(n))
            squares = [torch.cat([f, f.new_zeros(side * side - n)]).view(side, side) for f in flats]
            squares = [s + errors[r, b] if (r, b) in errors else s for r, s in enumerate(squares)]
            if b not in qs or not warm_start:
                generator = torch.Generator().manual_seed(int(seeds.randint(1_000_000_000)))
                qs[b] = torch.randn(side, min(side, matrix_approximation_rank), generator=generator)
            q = torch.linalg.qr(qs[b]).Q
            p = torch.linalg.qr(sum(s @ q for s in squares)).Q
            qs[b] = sum(s.t() @ p for s in squares) / world
            approximation = p @ qs[b].t()
            if use_error_feedback:
                errors.update({(r, b): s - approximation for r, s in enumerate(squares)})
            out.append(approximation.reshape(-1)[:n])
    return out


@pytest.mark.parametrize(("world", "options"), [
    (2, {"matrix_approximation_rank": 1}),
    (3, {"matrix_approximation_rank": 4, "warm_start": False}),  # QR, fresh Qs every step
    (2, {"matrix_approximation_rank": 2, "use_error_feedback": False}),
])
def test_batched_powersgd_averages_each_bucket_as_one_square_matrix(world: int, options: dict[str, Any]) -> None:
    out = run_ranks(_batched, world, options, timeout=90)
    expected = _batched_reference(world, **options)
    for rank in range(world):
        averages, (_, before, after) = out[rank]
        for i, (mine, theirs) in enumerate(zip(averages, expected, strict=True)):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, r=rank, i=i: f"rank {r}, step {i // 3} bucket {i % 3}: {m}")
        assert torch.equal(torch.cat(averages), torch.cat(out[0][0]))  # every replica gets the same
        # torch's count: each bucket's length before, two sides by the rank after
        sides = [math.ceil(math.sqrt(sum(math.prod(s) for s in shapes))) for shapes in LAYOUT]
        assert (before, after) == ((STEPS - START) * sum(sum(math.prod(s) for s in shapes) for shapes in LAYOUT),
                                   (STEPS - START) * sum(2 * side * min(side, options["matrix_approximation_rank"])
                                                         for side in sides))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _train_ddp(rank: int, world: int, gloo_port: int, shoal_port: int) -> dict[str, list[torch.Tensor]]:
    """The same replicas and batches trained by shoal's DDP with its hook, then by torch's DDP with torch's on
    gloo and on backend "shoal" (torch's hook starts all-reduces in its futures' callbacks and waits there)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    from shoal.parallel import DistributedDataParallel, PowerSGDState, batched_powerSGD_hook, powerSGD_hook

    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)) for _ in range(8)]

    def train(ddp_cls: type, state: Any, hook: Any) -> list[torch.Tensor]:
        net = _Net()
        model = ddp_cls(net)
        model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for x, y in batches:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in net.parameters()]

    out = {"shoal": train(DistributedDataParallel, PowerSGDState(None, 1, start_powerSGD_iter=3), powerSGD_hook)}
    # Two buckets in flight before the first is awaited; without warm start each drops its own factors.
    out["two buckets"] = train(functools.partial(DistributedDataParallel, bucket_cap_mb=0.004), PowerSGDState(
        None, 2, start_powerSGD_iter=3, warm_start=False), powerSGD_hook)
    out["batched"] = train(DistributedDataParallel, PowerSGDState(None, 1, start_powerSGD_iter=3),
                           batched_powerSGD_hook)
    for backend, port in (("gloo", gloo_port), ("shoal", shoal_port)):
        with _torch_group(rank, world, port, backend):
            out[f"torch on {backend}"] = train(nn.parallel.DistributedDataParallel, torch_powersgd.PowerSGDState(
                None, 1, start_powerSGD_iter=3), torch_powersgd.powerSGD_hook)
    return out


def test_ddp_with_powersgd_trains_the_replicas_as_torch_s_ddp_does() -> None:
    from shoal.ports import free_port

    out = run_ranks(_train_ddp, 2, free_port(), free_port(), timeout=90)
    for rank in range(2):
        for mine, theirs in zip(out[rank]["shoal"], out[rank]["torch on gloo"], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        for on_shoal, on_gloo in zip(out[rank]["torch on shoal"], out[rank]["torch on gloo"], strict=True):
            assert torch.equal(on_shoal, on_gloo)  # two ranks' sums: one rounding, in either library
        for key in ("shoal", "two buckets", "batched"):
            for mine, other in zip(out[rank][key], out[0][key], strict=True):
                assert torch.equal(mine, other)  # the replicas stay equal


def test_the_state_dict_carries_what_replicas_share_and_not_the_error() -> None:
    from shoal.parallel import PowerSGDState

    state = PowerSGDState(None, start_powerSGD_iter=2, random_seed=7)
    state.iter, state.error_dict[0] = 40, torch.ones(3)
    state.p_memory_dict[0], state.q_memory_dict[0] = torch.randn(5), torch.randn(4)
    state.rng.randint(10)
    joiner = PowerSGDState(None, start_powerSGD_iter=2)
    joiner.load_state_dict(state.state_dict())
    assert joiner.iter == 40 and joiner.error_dict == {}
    assert torch.equal(joiner.q_memory_dict[0], state.q_memory_dict[0])
    assert torch.equal(joiner.p_memory_dict[0], state.p_memory_dict[0])
    assert joiner.q_memory_dict[0] is not state.q_memory_dict[0]
    assert joiner.rng.randint(1_000_000_000) == state.rng.randint(1_000_000_000)  # the same projections next


def test_bad_arguments_raise_as_torch_s_do() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    from shoal.parallel import PowerSGDState

    for cls in (PowerSGDState, torch_powersgd.PowerSGDState):
        with pytest.raises(ValueError, match="start_powerSGD_iter"):
            cls(None, start_powerSGD_iter=1)
    PowerSGDState(None, start_powerSGD_iter=0, use_error_feedback=False, warm_start=False)  # allowed, as in torch
