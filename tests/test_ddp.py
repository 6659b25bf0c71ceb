"""DistributedDataParallel: gradients equal one process running the concatenated batch, replicas stay
identical, buckets reduce during backward, and structural mistakes are named, on "shoal" and "gloo"."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shoal.parallel.buckets import assign_buckets
from tests.ranks import run_ranks

BATCH = 6  # per rank


class _Branchy(nn.Module):
    """An MLP with a branch that forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
        self.unused = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    elif kind == "cnn":
        net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    else:
        net = _Branchy()
    return net.double()


def _batch(kind: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    shape = (BATCH, 1, 8, 8) if kind == "cnn" else (BATCH, 10)
    return torch.randn(shape, generator=gen, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=gen)


def _reference_grads(kind: str, world: int, steps: list[int],
                     ranks: list[int] | None = None) -> dict[str, torch.Tensor]:
    """One process, one model, the concatenation of the ranks' batches (summed over `steps`)."""
    net = _model(kind)
    if kind == "cnn":
        net.eval()  # batch statistics would differ between one big batch and per-rank batches
    for step in steps:
        xs, ys = zip(*[_batch(kind, r, step) for r in (ranks if ranks is not None else range(world))], strict=True)
        nn.functional.cross_entropy(net(torch.cat(xs)), torch.cat(ys)).backward()
    return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


_CASES = (("mlp", 0.001, False), ("cnn", 25, True), ("branchy", 0.0005, False))


def _all_cases(rank: int, world: int) -> list[dict]:
    return [_train_and_compare(rank, world, *case) for case in _CASES]


def _train_and_compare(rank: int, world: int, kind: str, bucket_cap_mb: float, as_view: bool) -> dict:
    from shoal.parallel import DistributedDataParallel

    net = _model(kind)
    if kind == "cnn":
        net.eval()
    ddp = DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=kind == "branchy",
                                  gradient_as_bucket_view=as_view)
    x, y = _batch(kind, rank, 0)
    nn.functional.cross_entropy(ddp(x), y).backward()
    want = _reference_grads(kind, world, [0])
    got = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys(), (sorted(got), sorted(want))  # the unused branch keeps grad None
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-12, atol=1e-12, msg=name)
    packed = [b.index for b in ddp.buckets if b._buffer is not None]
    if kind == "mlp":  # shoal reduces gradients where they lie and needs no bucket memory; gloo packs them
        assert (packed == []) == (ddp.process_group.backend == "shoal"), packed

    # Gradient accumulation: two steps under no_sync, the third synchronizes the sum of all three.
    views = not as_view or all(any(p.grad.untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()
                                   for b in ddp.buckets) for p in net.parameters())
    net.zero_grad()
    with ddp.no_sync():
        for step in (1, 2):
            x, y = _batch(kind, rank, step)
            nn.functional.cross_entropy(ddp(x), y).backward()
    local = _reference_grads(kind, world, [1, 2], ranks=[rank])  # nothing was averaged yet
    for name, param in net.named_parameters():
        if name in local:
            torch.testing.assert_close(param.grad, local[name], rtol=1e-12, atol=1e-12, msg=f"local {name}")
    x, y = _batch(kind, rank, 3)
    nn.functional.cross_entropy(ddp(x), y).backward()
    want = _reference_grads(kind, world, [1, 2, 3])
    for name, param in net.named_parameters():
        if name in want:
            torch.testing.assert_close(param.grad, want[name], rtol=1e-12, atol=1e-12, msg=f"no_sync {name}")

    # Several optimizer steps: replicas stay bitwise identical.
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(4, 8):
        optimizer.zero_grad()
        x, y = _batch(kind, rank, step)
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    return {"params": [p.detach().clone() for p in net.parameters()], "views": views}


@pytest.mark.parametrize("backend", ["shoal", "gloo"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_ddp_gradients_equal_single_process(backend: str, world: int) -> None:
    # MLP with many small buckets; CNN with BatchNorm (eval: see _reference_grads) and gradients as
    # bucket views; a model with an unused branch under find_unused_parameters.
    out = run_ranks(_all_cases, world, backend=backend, timeout=120)
    for (kind, _, _), *results in zip(_CASES, *(out[r] for r in range(world)), strict=True):
        assert all(r["views"] for r in results), f"{kind}: .grad is not a view of the bucket"
        for rank in range(1, world):
            for a, b in zip(results[0]["params"], results[rank]["params"], strict=True):
                assert torch.equal(a, b), f"{kind}: rank {rank} drifted from rank 0"


class _Optional(nn.Module):
    """A head that a rank may or may not use in a given step."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.extra = nn.Linear(10, 3), nn.Linear(10, 3)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        return self.body(x) + self.extra(x) if use_extra else self.body(x)


def _optional_model() -> nn.Module:
    torch.manual_seed(0)
    return _Optional().double()


def _partially_unused(rank: int, world: int) -> dict[str, torch.Tensor]:
    from shoal.parallel import DistributedDataParallel

    net = _optional_model()
    ddp = DistributedDataParallel(net, find_unused_parameters=True)
    with ddp.no_sync():  # every rank uses the extra head here...
        x, y = _batch("mlp", rank, 0)
        nn.functional.cross_entropy(ddp(x, True), y).backward()
    x, y = _batch("mlp", rank, 1)  # ...and only rank 1 in the step that synchronizes
    nn.functional.cross_entropy(ddp(x, rank == 1), y).backward()
    return {n: p.grad.clone() for n, p in net.named_parameters()}


def test_parameters_unused_on_some_ranks_average_with_what_others_accumulated() -> None:
    out = run_ranks(_partially_unused, 2)
    net = _optional_model()
    for rank in range(2):  # the mean of the ranks' losses, summed over both steps, in one process
        for step, use in ((0, True), (1, rank == 1)):
            x, y = _batch("mlp", rank, step)
            (nn.functional.cross_entropy(net(x, use), y) / 2).backward()
    for rank in range(2):
        for name, param in net.named_parameters():
            torch.testing.assert_close(out[rank][name], param.grad, rtol=1e-12, atol=1e-12, msg=name)


def _used_by_one_rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    from shoal.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(_optional_model(), find_unused_parameters=True)
    x, y = _batch("mlp", rank, 0)
    # Rank 0 has no gradient for the extra head: it packs zeros into that bucket, while rank 1 reduces
    # its gradients where they lie; both take part in the same collective.
    nn.functional.cross_entropy(ddp(x, rank == 1), y).backward()
    assert [b._buffer is not None for b in ddp.buckets] == [rank == 0], "each rank took its own way"
    return {n: p.grad.clone() for n, p in ddp.module.named_parameters()}


def _extra_head_on_rank_1() -> nn.Module:
    """The model with one process's gradients of the two ranks' mean loss, the extra head used by rank 1 only."""
    net = _optional_model()
    for rank in range(2):
        x, y = _batch("mlp", rank, 0)
        (nn.functional.cross_entropy(net(x, rank == 1), y) / 2).backward()
    return net


def test_a_rank_without_some_gradients_and_one_with_all_reduce_together() -> None:
    out = run_ranks(_used_by_one_rank, 2)
    net = _extra_head_on_rank_1()
    for rank in range(2):
        for name, param in net.named_parameters():
            torch.testing.assert_close(out[rank][name], param.grad, rtol=1e-12, atol=1e-12, msg=name)


def _narrowed(rank: int, world: int, how: str) -> dict[str, torch.Tensor]:
    from shoal.parallel import DistributedDataParallel, allreduce_hook, bf16_compress_wrapper

    def narrowing_hook(state: Any, bucket: Any) -> Any:  # as torch's compress wrappers do: answers in bfloat16
        bucket.set_buffer(bucket.buffer().to(torch.bfloat16))
        return allreduce_hook(state, bucket)

    ddp = DistributedDataParallel(_optional_model(), find_unused_parameters=True)
    ddp.register_comm_hook(None, narrowing_hook if how == "hook" else bf16_compress_wrapper(allreduce_hook))
    x, y = _batch("mlp", rank, 0)
    nn.functional.cross_entropy(ddp(x, rank == 1), y).backward()  # rank 0's extra head gets its .grad here
    return {n: p.grad.clone() for n, p in ddp.module.named_parameters()}


def test_a_hook_answering_in_another_dtype_gives_gradients_in_the_parameters() -> None:
    out = {how: run_ranks(_narrowed, 2, how) for how in ("hook", "wrapper")}
    net = _extra_head_on_rank_1()
    for rank in range(2):
        for name, param in net.named_parameters():
            grad = out["hook"][rank][name]
            assert grad.dtype == torch.float64 and torch.equal(grad, out["wrapper"][rank][name]), name
            torch.testing.assert_close(grad, param.grad, rtol=2e-2, atol=2e-3, msg=name)  # bfloat16's digits


def _overlap(rank: int, world: int) -> tuple[int, int]:
    from shoal.parallel import DistributedDataParallel

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.3)
    ddp(torch.randn(32, 256)).sum().backward()
    return len(ddp.buckets), ddp.launched_in_backward


def test_buckets_start_reducing_before_backward_ends() -> None:
    for buckets, early in run_ranks(_overlap, 2).values():
        # Only the bucket holding the first layer can wait for the end; the others start in backward.
        assert buckets >= 4 and early >= buckets - 1, (buckets, early)


def _broadcast_and_buffers(rank: int, world: int) -> list[torch.Tensor]:
    from shoal.parallel import DistributedDataParallel

    torch.manual_seed(rank)  # different initial weights per rank: DDP must replace them with rank 0's
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    # A transposed weight is not contiguous: it is broadcast through a staging copy, copied back into
    # a leaf that requires grad (from the group's thread, outside DDP's no_grad).
    net[0].weight = nn.Parameter(torch.randn(4, 4).t())
    ddp = DistributedDataParallel(net)
    ddp(torch.randn(8, 4) * (rank + 1))  # train mode: BN statistics diverge per rank...
    ddp.eval()
    ddp(torch.randn(8, 4))  # ...and the next forward takes rank 0's before running (eval: no update)
    return [t.detach().clone() for t in [*net.parameters()]] + [net[1].running_mean.clone()]


def test_replicas_start_from_rank0_and_buffers_follow_it() -> None:
    out = run_ranks(_broadcast_and_buffers, 3)
    for rank in (1, 2):
        for a, b in zip(out[0], out[rank], strict=True):
            assert torch.equal(a, b)


def _mismatched(rank: int, world: int) -> str:
    from shoal.parallel import DistributedDataParallel

    net = nn.Linear(4, 4 if rank == 0 else 5)
    with pytest.raises(ValueError, match="differs between ranks") as info:
        DistributedDataParallel(net)
    return str(info.value)


def test_parameter_mismatch_names_parameter_and_ranks() -> None:
    for message in run_ranks(_mismatched, 2).values():
        assert "weight" in message and "ranks 0" in message and "and 1" in message


def _unused_without_flag(rank: int, world: int) -> str:
    from shoal.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(_Branchy())
    with pytest.raises(RuntimeError, match="got no gradient") as info:
        ddp(torch.randn(2, 10)).sum().backward()
    return str(info.value)


def test_unused_parameter_without_flag_is_named() -> None:
    for message in run_ranks(_unused_without_flag, 2).values():
        assert "unused.weight" in message and "find_unused_parameters" in message


def _compressed(rank: int, world: int, hook_name: str) -> float:
    from shoal import parallel

    net = _model("mlp")
    ddp = parallel.DistributedDataParallel(net)
    ddp.register_comm_hook(None, getattr(parallel, hook_name))
    x, y = _batch("mlp", rank, 0)
    nn.functional.cross_entropy(ddp(x), y).backward()
    want = _reference_grads("mlp", world, [0])
    return max(((p.grad - want[n]).abs().max() / want[n].abs().max()).item() for n, p in net.named_parameters())


@pytest.mark.parametrize("hook", ["fp16_compress_hook", "bf16_compress_hook"])
def test_compression_hooks_average_within_their_precision(hook: str) -> None:
    tolerance = {"fp16_compress_hook": 2e-3, "bf16_compress_hook": 2e-2}[hook]
    for error in run_ranks(_compressed, 2, hook).values():
        assert 0 < error < tolerance  # not exact (it was compressed) but close


def test_bucket_assignment_is_reverse_ordered_small_first_and_per_dtype() -> None:
    params = [torch.zeros(100), torch.zeros(100), torch.zeros(50, dtype=torch.float64), torch.zeros(300),
              torch.zeros(200)]
    buckets = assign_buckets(params, cap_bytes=1600, first_cap_bytes=800)
    assert buckets[0] == [4]  # the last parameter, alone: 800 bytes fill the small first bucket
    assert buckets[1] == [3, 1]  # then ordinary caps, float32 only
    assert [2] in buckets and [0] in buckets
    assert sorted(i for b in buckets for i in b) == list(range(len(params)))
    assert assign_buckets(params, 1600, 800) == buckets


def _torch_style_devices(rank: int, world: int) -> tuple[dict[str, torch.Tensor], str]:
    from shoal.parallel import DistributedDataParallel

    net = _model("mlp")
    ddp = DistributedDataParallel(net, device_ids=None, output_device=None)  # torch's CPU form
    x, y = _batch("mlp", rank, 0)
    nn.functional.cross_entropy(ddp(x), y).backward()
    with pytest.raises(ValueError, match=r"device_ids \[0\] must name the one GPU") as refused:
        DistributedDataParallel(_model("mlp"), device_ids=[0])
    return {n: p.grad for n, p in net.named_parameters()}, str(refused.value)


def test_torch_style_device_arguments_are_accepted_for_cpu_and_checked() -> None:
    want = _reference_grads("mlp", 2, [0])
    for grads, refusal in run_ranks(_torch_style_devices, 2).values():
        assert "['cpu']" in refusal
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want[name], rtol=1e-12, atol=1e-12, msg=name)


def _released(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A backward after `release` keeps this rank's own gradient; a second DDP over the module averages."""
    from shoal.parallel import DistributedDataParallel

    net = _model("mlp")
    first = DistributedDataParallel(net)
    first.release()
    x, y = _batch("mlp", rank, 0)
    nn.functional.cross_entropy(first(x), y).backward()
    own = net[0].weight.grad.clone()
    net.zero_grad()
    nn.functional.cross_entropy(DistributedDataParallel(net)(x), y).backward()
    return own, net[0].weight.grad.clone()


def test_a_released_ddp_averages_no_more_and_another_may_wrap_its_module() -> None:
    out = run_ranks(_released, 2)
    for rank in range(2):
        net = _model("mlp")
        x, y = _batch("mlp", rank, 0)
        nn.functional.cross_entropy(net(x), y).backward()
        torch.testing.assert_close(out[rank][0], net[0].weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[0][1], (out[0][0] + out[1][0]) / 2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=0, atol=0)
