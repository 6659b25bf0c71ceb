"""Training with less communication on a GPU. On the same CUDA replicas and batches:
- shoal's DDP with shoal's fp16, bf16 and PowerSGD hooks trains to the parameters torch's DDP reaches with
  torch's hooks;
- shoal's post-local SGD trains as torch's does;
- DiLoCo trains as the same run on the CPU does.
torch's side runs on torch.distributed's backend "shoal", which stages CUDA tensors through host memory, so
that two ranks can share the one GPU a test machine may have (NCCL refuses that). Skipped where there is no
GPU, as in CI."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from tests.ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 6


def _net(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)


def _batches(rank: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank its own data, so that averaging (and how it is compressed) matters."""
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=gen, dtype=dtype), torch.randint(0, 4, (8,), generator=gen))
            for _ in range(STEPS)]


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list, device: torch.device
           ) -> list[torch.Tensor]:
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
    return [p.detach().cpu() for p in model.parameters()]


@contextmanager
def _torch_on_shoal(rank: int, world: int, port: int) -> Iterator[None]:
    """torch's default group, on backend "shoal", for the block."""
    import torch.distributed as tdist

    import shoal  # noqa: F401 - registers backend "shoal"

    tdist.init_process_group("shoal", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
    finally:
        tdist.destroy_process_group()


def _gpu() -> torch.device:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device


def _hooked(rank: int, world: int, torch_port: int, hook: str) -> dict[str, list[torch.Tensor]]:
    """The same replicas trained by shoal's DDP with shoal's `hook`, then by torch's DDP with torch's."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    from shoal import parallel

    device, batches, out = _gpu(), _batches(rank), {}
    powersgd = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}

    net = _net().to(device)
    model = parallel.DistributedDataParallel(net, device_ids=[0])
    model.register_comm_hook(parallel.PowerSGDState(None, **powersgd) if hook == "powerSGD_hook" else None,
                             getattr(parallel, hook))
    out["shoal"] = _train(model, torch.optim.SGD(net.parameters(), lr=0.1), batches, device)
    with _torch_on_shoal(rank, world, torch_port):
        net = _net().to(device)
        model = nn.parallel.DistributedDataParallel(net, device_ids=[0])
        if hook == "powerSGD_hook":
            model.register_comm_hook(torch_powersgd.PowerSGDState(None, **powersgd), torch_powersgd.powerSGD_hook)
        else:
            model.register_comm_hook(None, getattr(default_hooks, hook))
        out["torch"] = _train(model, torch.optim.SGD(net.parameters(), lr=0.1), batches, device)
    return out


@pytest.mark.parametrize("hook", ["fp16_compress_hook", "bf16_compress_hook", "powerSGD_hook"])
def test_shoal_s_hooks_train_cuda_replicas_as_torch_s_hooks_do(hook: str) -> None:
    from shoal.ports import free_port

    out = run_ranks(_hooked, 2, free_port(), hook, timeout=120)
    exact = [p.detach() for p in _net().parameters()]  # not what they reach: the hook compressed
    for rank in range(2):
        for mine, theirs, other in zip(out[rank]["shoal"], out[rank]["torch"], out[0]["shoal"], strict=True):
            # Two ranks' halves add in one rounding, whichever order: the same bits, up to SGD's float32 sums.
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=f"rank {rank}, {hook}")
            assert torch.equal(mine, other)  # the replicas stay equal
    assert not all(torch.equal(a, b) for a, b in zip(out[0]["shoal"], exact, strict=True))  # it trained


def _post_local_sgd(rank: int, world: int, torch_port: int) -> dict[str, list[torch.Tensor]]:
    import torch.distributed.algorithms.model_averaging.averagers as torch_averagers
    from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer

    from shoal.optim import PostLocalSGDOptimizer
    from shoal.parallel import PeriodicModelAverager

    device, batches, out = _gpu(), _batches(rank, torch.float64), {}
    net = _net(torch.float64).to(device)
    inner = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    out["shoal"] = _train(net, PostLocalSGDOptimizer(inner, PeriodicModelAverager(3, warmup_steps=2)), batches,
                          device)
    with _torch_on_shoal(rank, world, torch_port):
        net = _net(torch.float64).to(device)
        inner = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        out["torch"] = _train(net, TorchPostLocalSGDOptimizer(inner, torch_averagers.PeriodicModelAverager(3, 2)),
                              batches, device)
    return out


def test_post_local_sgd_trains_cuda_replicas_as_torch_s_does() -> None:
    from shoal.ports import free_port

    out = run_ranks(_post_local_sgd, 2, free_port(), timeout=120)
    for rank in range(2):
        for mine, theirs in zip(out[rank]["shoal"], out[rank]["torch"], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12, msg=f"rank {rank}")
    # Averaged at the last step (5 = 2 + 3): the replicas agree.
    for mine, other in zip(out[0]["shoal"], out[1]["shoal"], strict=True):
        assert torch.equal(mine, other)


def _diloco(rank: int, world: int, device_name: str) -> list[torch.Tensor]:
    from shoal.optim import DiLoCoOptimizer

    device = _gpu() if device_name == "cuda" else torch.device("cpu")
    torch.manual_seed(rank)  # each rank starts elsewhere: DiLoCo starts every replica from rank 0's values
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).double().to(device)
    inner = torch.optim.AdamW(net.parameters(), lr=0.05)
    outer = torch.optim.SGD(net.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return _train(net, DiLoCoOptimizer(inner, outer, sync_every=3), _batches(rank, torch.float64), device)


def test_diloco_trains_cuda_replicas_as_it_trains_cpu_ones() -> None:
    on_cpu = run_ranks(_diloco, 2, "cpu", timeout=120)
    on_gpu = run_ranks(_diloco, 2, "cuda", timeout=120)
    for rank in range(2):
        for got, want, other in zip(on_gpu[rank], on_cpu[rank], on_gpu[0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=f"rank {rank}")
            assert torch.equal(got, other)  # synchronized after step 6: the replicas agree
