"""The GPU paths: CUDA tensors through shoal's own backend and gloo (staged through host memory), the
NCCL backend, DDP on a GPU, and torch's programs under the device map "cpu:shoal,cuda:nccl". Every rank
shares the one GPU a test machine may have (NCCL refuses two ranks on one device, so its tests run one
rank). Skipped where there is no GPU, as in CI."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _collectives(rank: int, world: int) -> dict[str, bool]:
    import shoal.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    out = {}
    base = torch.arange(1001, dtype=torch.float32, device=device)

    summed = base * (rank + 1)
    dist.all_reduce(summed)
    out["all_reduce"] = summed.device == device and torch.equal(summed.cpu(), base.cpu() * sum(range(1, world + 1)))

    largest = base + rank
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    out["max"] = torch.equal(largest.cpu(), base.cpu() + world - 1)

    strided = torch.zeros(8, 6, device=device)[:, ::2]  # not contiguous: staged and copied back in place
    strided += rank + 1
    dist.all_reduce(strided)
    out["strided"] = torch.equal(strided.cpu(), torch.full((8, 3), float(sum(range(1, world + 1)))))

    sent = base.clone() if rank == 0 else torch.zeros_like(base)
    dist.broadcast(sent, src=0)
    out["broadcast"] = torch.equal(sent.cpu(), base.cpu())

    gathered = [torch.empty(5, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.full((5,), rank, dtype=torch.int64, device=device))
    out["all_gather"] = [g.device for g in gathered] == [device] * world and \
        [g.tolist() for g in gathered] == [[r] * 5 for r in range(world)]

    shard = torch.empty(3, dtype=torch.float64, device=device)
    dist.reduce_scatter(shard, [torch.full((3,), float(r + 10 * rank), dtype=torch.float64, device=device)
                                for r in range(world)])
    out["reduce_scatter"] = torch.equal(shard.cpu(), torch.full((3,), float(world * rank + 10 * sum(range(world))),
                                                                dtype=torch.float64))

    gathered = [torch.empty(2, device=device) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank), device=device), gathered, dst=0)
    if rank == 0:
        out["gather"] = [g.tolist() for g in gathered] == [[float(r)] * 2 for r in range(world)]

    piece = torch.empty(3, device=device)
    dist.scatter(piece, [torch.full((3,), float(r), device=device) for r in range(world)] if rank == 0 else None,
                 src=0)
    out["scatter"] = piece.tolist() == [float(rank)] * 3

    received = [torch.empty(2, dtype=torch.int32, device=device) for _ in range(world)]
    dist.all_to_all(received, [torch.full((2,), 10 * rank + r, dtype=torch.int32, device=device)
                               for r in range(world)])
    out["all_to_all"] = [r.tolist() for r in received] == [[10 * r + rank] * 2 for r in range(world)]

    if world > 1:
        message = torch.zeros(4, dtype=torch.bfloat16, device=device)
        if rank == 0:
            dist.send(torch.arange(4, dtype=torch.bfloat16, device=device), dst=1)
        elif rank == 1:
            dist.recv(message, src=0)
            out["send_recv"] = message.device == device and message.tolist() == [0, 1, 2, 3]
    dist.barrier()
    return out


@pytest.mark.parametrize(("backend", "world"), [("shoal", 2), ("shoal", 3), ("gloo", 2), ("nccl", 1)])
def test_cuda_tensors_reduce_gather_and_travel_on_every_backend(backend: str, world: int) -> None:
    results = run_ranks(_collectives, world, backend=backend, timeout=120)
    for rank, checks in results.items():
        assert checks and all(checks.values()), f"rank {rank}: {checks}"
    if world > 1:
        assert results[1]["send_recv"]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3)).double()


def _batches(steps: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4 * world, 12, generator=generator, dtype=torch.float64),
             torch.randint(0, 3, (4 * world,), generator=generator)) for _ in range(steps)]


def _train(model: nn.Module, rank: int, world: int, steps: int, device: torch.device) -> None:
    """`steps` SGD steps of this rank's share of each batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches(steps, world):
        mine = slice(4 * rank, 4 * (rank + 1))
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[mine].to(device)), y[mine].to(device)).backward()
        optimizer.step()


def _train_ddp_on_gpu(rank: int, world: int, steps: int) -> list[torch.Tensor]:
    from shoal.parallel import DistributedDataParallel

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    # find_unused_parameters: its flags go through the group too.
    model = DistributedDataParallel(_net().to(device), device_ids=[0], bucket_cap_mb=0.004,
                                    find_unused_parameters=True)
    _train(model, rank, world, steps, device)
    return [p.detach().cpu() for p in model.module.parameters()]


@pytest.mark.parametrize(("backend", "world"), [("shoal", 2), ("gloo", 2), ("nccl", 1)])
def test_ddp_on_a_gpu_trains_as_one_process_on_the_whole_batch(backend: str, world: int) -> None:
    steps = 5
    results = run_ranks(_train_ddp_on_gpu, world, steps, backend=backend, timeout=120)
    reference = _net()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches(steps, world):
        optimizer.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        optimizer.step()
    for rank, params in results.items():
        for got, want in zip(params, reference.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-9, atol=1e-12, msg=f"rank {rank}")


def _torch_under_the_device_map(rank: int, world: int, port: int, steps: int) -> dict[str, bool]:
    import torch.distributed as tdist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import shoal  # noqa: F401 - registers backend "shoal"
    from shoal.comm.as_torch.work import TorchWork

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    tdist.init_process_group("cpu:shoal,cuda:nccl", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {}
    try:
        on_gpu = torch.arange(6.0, device=device)
        work = tdist.all_reduce(on_gpu, async_op=True)
        work.wait()
        out["cuda tensors on nccl"] = not isinstance(work, TorchWork) and \
            torch.equal(on_gpu.cpu(), torch.arange(6.0) * world)
        on_cpu = torch.arange(6.0)
        work = tdist.all_reduce(on_cpu, async_op=True)
        work.wait()
        out["cpu tensors on shoal"] = isinstance(work, TorchWork) and torch.equal(on_cpu, torch.arange(6.0) * world)
        gathered = torch.empty(2 * world, device=device)
        tdist.all_gather_into_tensor(gathered, torch.full((2,), float(rank), device=device))
        out["all_gather_into_tensor"] = gathered.tolist() == [float(r) for r in range(world) for _ in range(2)]
        reduced = funcol.all_reduce(torch.ones(3, device=device), "sum", tdist.group.WORLD)
        out["functional"] = torch.equal(reduced.cpu(), torch.full((3,), float(world)))

        ddp = DistributedDataParallel(_net().to(device), device_ids=[0])
        sharded = _net().to(device)
        for layer in sharded:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(sharded)
        for model in (ddp, sharded):
            _train(model, rank, world, steps, device)
        out["ddp"] = [p.detach().cpu() for p in ddp.module.parameters()]
        out["fsdp2"] = [p.full_tensor().detach().cpu() for p in sharded.parameters()]
    finally:
        tdist.destroy_process_group()
    return out


def test_torch_ddp_and_fsdp2_on_the_gpu_keep_nccl_under_the_device_map() -> None:
    """NCCL refuses two ranks on one device: one rank, as this machine has one GPU."""
    steps = 5
    results = run_ranks(_torch_under_the_device_map, 1, steps, backend=None, timeout=120)
    reference = _net()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches(steps, 1):
        optimizer.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        optimizer.step()
    checks = results[0]
    for model in ("ddp", "fsdp2"):
        for got, want in zip(checks.pop(model), reference.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-9, atol=1e-12, msg=model)
    assert all(checks.values()), checks
