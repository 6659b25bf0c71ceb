"""torch's own parallelism on backend "shoal" trains as it does on gloo: DDP, FSDP2 (`fully_shard`), DTensor
redistribution, tensor parallelism, a 2-D mesh of both, and distributed checkpoints (DCP); a lost peer
ends torch's waiting operation with torch's error; torch's groups and shoal's share one world."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.ranks import run_ranks
from tests.small_gpt import SmallGPT

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def _init(backend: str, rank: int, world: int, port: int) -> None:
    import torch.distributed as tdist

    import shoal  # noqa: F401 - registers backend "shoal"

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    tdist.init_process_group(backend, f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                             timeout=timedelta(seconds=60))


def _ddp_grads(rank: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)  # a bucket per parameter
    ddp(torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _fsdp2_losses_and_checkpoint(rank: int, checkpoint: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    def sharded(seed: int) -> SmallGPT:
        torch.manual_seed(seed)
        model = SmallGPT(vocab=64, dim=32, blocks=2, heads=4)
        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)

    model = sharded(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    tokens = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(rank))  # one batch, learnt
    for _ in range(4):
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    dcp.save(model.state_dict(), checkpoint_id=checkpoint)
    restored = sharded(1)  # other weights, which the checkpoint replaces
    state = restored.state_dict()
    dcp.load(state, checkpoint_id=checkpoint)
    restored.load_state_dict(state)
    probe = torch.arange(11).reshape(1, 11)
    return {"losses": losses, "restored": torch.equal(model(probe), restored(probe))}


def _dtensor_and_tensor_parallel(world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(world * 8.0).reshape(world * 2, 4)
    replicated = distribute_tensor(full, mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
    by_column = replicated.redistribute(mesh, [Shard(1)])
    torch.manual_seed(1)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    whole = mlp(x)
    split = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return {"replicated": torch.equal(replicated.to_local(), full), "column": by_column.to_local().tolist(),
            "tp_error": (split(x) - whole).abs().max().item()}


def _torch_parallelism(rank: int, world: int, port: int, backend: str, checkpoint: str) -> dict:
    import torch.distributed as tdist

    _init(backend, rank, world, port)
    try:
        return {"ddp": _ddp_grads(rank), **_fsdp2_losses_and_checkpoint(rank, Path(checkpoint)),
                **_dtensor_and_tensor_parallel(world)}
    finally:
        tdist.destroy_process_group()


def test_ddp_fsdp2_dtensor_tensor_parallel_and_dcp_train_as_on_gloo(tmp_path: Path) -> None:
    out = {backend: run_ranks(_torch_parallelism, 2, backend, str(tmp_path / backend), backend=None, timeout=180)
           for backend in ("gloo", "shoal")}
    for rank in range(2):
        gloo, shoal = out["gloo"][rank], out["shoal"][rank]
        assert all(torch.equal(a, b) for a, b in zip(gloo["ddp"], shoal["ddp"], strict=True))
        assert shoal["losses"] == pytest.approx(gloo["losses"], rel=1e-5)
        assert shoal["losses"][-1] < shoal["losses"][0]
        assert shoal["restored"] and shoal["replicated"]
        assert shoal["column"] == gloo["column"] == [[4.0 * r + 2 * rank + c for c in range(2)] for r in range(4)]
        assert shoal["tp_error"] < 1e-5


def _fsdp_with_tensor_parallel(rank: int, world: int, port: int, backend: str) -> list[float]:
    """A 2x2 mesh: data parallel (FSDP2) across rows, tensor parallel within each row, as torch's
    fsdp_tp_example does."""
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _init(backend, rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for step in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * mesh["dp"].get_local_rank() + step))
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses
    finally:
        tdist.destroy_process_group()


def test_fsdp2_with_tensor_parallel_on_a_2x2_mesh_trains_as_on_gloo() -> None:
    out = {backend: run_ranks(_fsdp_with_tensor_parallel, 4, backend, backend=None, timeout=180)
           for backend in ("gloo", "shoal")}
    for rank in range(4):
        assert out["shoal"][rank] == pytest.approx(out["gloo"][rank], rel=1e-5)


def _loses_a_peer(rank: int, world: int, port: int) -> str:
    import torch.distributed as tdist

    _init("shoal", rank, world, port)
    tdist.all_reduce(torch.ones(4))
    if rank == 1:
        os._exit(1)
    try:
        while True:  # until the loss is seen: an op may complete before rank 1 is gone
            tdist.all_reduce(torch.ones(4))
    except tdist.DistBackendError as exc:
        seen = f"{type(exc.__cause__).__name__}: {exc}"
    with pytest.raises(tdist.DistBackendError, match="failed earlier"):  # a broken group refuses at once
        tdist.all_reduce(torch.ones(4), async_op=True).get_future().wait()
    return seen


def test_a_lost_peer_ends_torchs_waiting_op_with_dist_backend_error_naming_it() -> None:
    """Within the heartbeat's reach, not the group's 60 s timeout: the run's 30 s deadline would fail first."""
    out = run_ranks(_loses_a_peer, 2, backend=None, timeout=30, expect={1: "dies"})
    assert out[0].startswith("PeerFailure: ") and "rank 1" in out[0]


def _one_world(rank: int, world: int, port: int, ports: list[int]) -> dict:
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh

    import shoal.distributed as dist

    torch_port, later_port, gloo_port = ports
    seen = {}
    # shoal first: torch gets its default group over shoal's world, and shoal takes torch's groups back
    dist.init_process_group("shoal", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    seen["torch_backend"] = tdist.get_backend()
    mesh = init_device_mesh("cpu", (world,))
    tensor = torch.full((2,), float(rank + 1))
    dist.all_reduce(tensor, group=mesh.get_group())
    seen["shoal_on_torch_group"] = tensor[0].item()
    tail = tdist.new_group(list(range(1, world)))  # a subgroup of the world's connections, rank 0 outside
    if rank > 0:
        tensor = torch.full((2,), float(rank))
        dist.all_reduce(tensor, group=tail)
        seen["shoal_on_torch_subgroup"] = tensor[0].item()
        dist.destroy_process_group(tail)  # torch's registry lets go of it too
        with pytest.raises(ValueError, match="Invalid process group"):
            tdist.destroy_process_group(tail)
    tensor = torch.ones(2)
    tdist.all_reduce(tensor)
    seen["torch_on_shoal_world"] = tensor[0].item()
    dist.destroy_process_group()
    seen["torch_left_initialized"] = tdist.is_initialized()
    # torch first: shoal's init takes torch's world rather than making a second one
    tdist.init_process_group("shoal", f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=world)
    dist.init_process_group("shoal", "tcp://127.0.0.1:1", rank=rank, world_size=world)  # no rendezvous made
    tensor = torch.ones(2)
    dist.all_reduce(tensor)
    seen["shoal_on_torch_world"] = tensor[0].item()
    dist.destroy_process_group()
    tdist.all_reduce(tensor)  # torch's group outlives shoal's destroy
    seen["torch_after_shoal_destroy"] = tensor[0].item()
    dist.init_process_group("shoal", "tcp://127.0.0.1:1", rank=rank, world_size=world)
    tdist.destroy_process_group()  # torch's destroy, first, ends the world shoal shared
    seen["shoal_left_initialized"] = dist.is_initialized()
    # a script that initializes torch itself after shoal's init takes back the default group shoal lent
    dist.init_process_group("shoal", f"tcp://127.0.0.1:{later_port}", rank=rank, world_size=world)
    tdist.init_process_group("gloo", f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world)
    seen["torch_own_backend"] = tdist.get_backend()
    with pytest.raises(TypeError, match="backend 'shoal'"):
        dist.all_reduce(tensor, group=tdist.group.WORLD)
    dist.all_reduce(tensor)
    tdist.all_reduce(tensor)
    seen["both_after"] = tensor[0].item()
    dist.destroy_process_group()
    tdist.destroy_process_group()
    return seen


def test_torch_and_shoal_share_one_world_either_way() -> None:
    from shoal.ports import free_port

    out = run_ranks(_one_world, 3, [free_port() for _ in range(3)], backend=None, timeout=90)
    for rank in range(3):
        assert out[rank] == {"torch_backend": "shoal", "shoal_on_torch_group": 6.0, "torch_on_shoal_world": 3.0,
                             **({"shoal_on_torch_subgroup": 3.0} if rank else {}),
                             "torch_left_initialized": False, "shoal_on_torch_world": 3.0,
                             "torch_after_shoal_destroy": 9.0, "shoal_left_initialized": False,
                             "torch_own_backend": "gloo", "both_after": 81.0}


@pytest.mark.parametrize("launcher", ["shoal.run", "torch.distributed.run"])
def test_a_torch_program_on_backend_shoal_runs_under_either_launcher(launcher: str) -> None:
    from shoal.ports import free_port

    result = subprocess.run([sys.executable, "-m", launcher, "--nproc-per-node", "2", "--master-port", str(free_port()),
                             str(SCRIPTS / "torch_on_shoal_env.py")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # the bias's gradient: 2 samples on each rank, averaged over the ranks
    assert result.stdout.count("backend shoal sum 3 grad 2") == 2, result.stdout
