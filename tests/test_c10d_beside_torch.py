"""shoal's "gloo" groups leave torch.distributed's global state to the script: a script may initialize
torch.distributed itself beside shoal, in either order, and shoal's groups can be rebuilt."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as tdist

import shoal.distributed as dist
from shoal.ports import free_port
from tests.ranks import run_ranks


def _beside_torch(rank: int, world: int, _: int, ports: list[tuple[int, int]]) -> list[float]:
    """Twice: torch's default group and shoal's world side by side, made in one order, then the other."""
    seen = []
    for round_, (torch_port, shoal_port) in enumerate(ports):
        inits = [partial(library.init_process_group, "gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
                 for library, port in ((tdist, torch_port), (dist, shoal_port))]
        for init in inits if round_ == 0 else reversed(inits):
            init()
        ours = torch.full((4,), float(rank + 1))
        dist.all_reduce(ours)
        theirs = torch.full((4,), 10.0 * (rank + 1))
        tdist.all_reduce(theirs)
        tail = dist.new_group([1, 2])  # only its members build anything
        if tail != dist.GroupMember.NON_GROUP_MEMBER:
            block = torch.full((3,), float(rank))
            dist.broadcast(block, src=2, group=tail)
            seen.append(block[0].item())
        seen += [ours[0].item(), theirs[0].item(), float(tdist.get_world_size())]
        dist.destroy_process_group()
        assert tdist.is_initialized()  # shoal's destroy leaves the script's group alone
        tdist.all_reduce(theirs)
        tdist.destroy_process_group()
    return seen


def test_shoal_gloo_groups_live_beside_the_scripts_own_torch_distributed() -> None:
    """Before shoal built its gloo engines itself, its init_process_group("gloo") raised once the script
    had initialized torch.distributed, and the script's init raised after shoal's."""
    ports = [(free_port(), free_port()) for _ in range(2)]
    out = run_ranks(_beside_torch, 3, ports, backend=None)
    for rank in range(3):
        once = ([2.0] if rank > 0 else []) + [6.0, 60.0, 3.0]
        assert out[rank] == once * 2
