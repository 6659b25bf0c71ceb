"""Object collectives (broadcast_object_list, all_gather_object, gather_object, scatter_object_list) on
real ranks: each rank returns what it received, and the test compares it with what torch.distributed's
own object collectives give for the same call, on a gloo group of the same ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.ranks import run_ranks
from tests.reference import same


def _objects_of(rank: int) -> list[Any]:
    """Objects of several kinds and sizes, different on each rank."""
    return [{"rank": rank, "name": f"worker{rank}"}, torch.arange(rank * 3, dtype=torch.float64), "x" * (rank * 5000),
            None, (rank, [rank] * rank)]


def _every_collective(rank: int, world: int, dist: Any, group: Any) -> dict[str, Any]:
    """What each object collective leaves on this rank, with torch.distributed's names and arguments."""
    got: dict[str, Any] = {}
    broadcast = _objects_of(rank)
    dist.broadcast_object_list(broadcast, src=1, group=group)
    got["broadcast"] = broadcast
    gathered = [None] * world
    dist.all_gather_object(gathered, _objects_of(rank)[rank % 5], group=group)
    got["all_gather"] = gathered
    at_dst = [None] * world if rank == 0 else None
    dist.gather_object(_objects_of(rank), at_dst, dst=0, group=group)
    got["gather"] = at_dst
    out = [None]
    dist.scatter_object_list(out, [_objects_of(r) for r in range(world)] if rank == world - 1 else None,
                             src=world - 1, group=group)
    got["scatter"] = out
    return got


def _shoal_and_torch(rank: int, world: int, torch_port: int) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch.distributed as torch_dist

    import shoal.distributed as dist

    ours = _every_collective(rank, world, dist, None)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=world)
    try:
        theirs = _every_collective(rank, world, torch_dist, None)
    finally:
        torch_dist.destroy_process_group()
    return ours, theirs


@pytest.mark.parametrize("world", [2, 3])
def test_object_collectives_leave_what_torch_distributed_leaves(world: int) -> None:
    from shoal.ports import free_port

    outcomes = run_ranks(_shoal_and_torch, world, free_port(), timeout=90)
    for rank, (ours, theirs) in outcomes.items():
        for name in ours:
            assert same(ours[name], theirs[name]), f"rank {rank}, {name}: shoal {ours[name]!r} torch {theirs[name]!r}"
    assert outcomes[0][0]["gather"][2 % world] is not None  # the dst really holds every rank's objects


def _bad_list_lengths(rank: int, world: int) -> list | str:
    """Rank 0 passes a list too short for the group; rank 1 one longer than it (extra entries stay)."""
    import shoal.distributed as dist

    if rank == 0:
        with pytest.raises(ValueError, match=r"object_list must hold an entry per rank of the group \(2\), got 1"):
            dist.all_gather_object([None], "zero")
        with pytest.raises(ValueError, match="give src=0 or group_src=0, not both"):
            dist.broadcast_object_list([rank], src=0, group_src=0)
        return "raised"
    longer = [None, None, "kept"]
    dist.all_gather_object(longer, "one")  # completes: the short list fails on rank 0 after the collective
    return longer


def test_a_list_too_short_is_named_after_the_collective_and_a_longer_one_keeps_its_tail() -> None:
    assert run_ranks(_bad_list_lengths, 2) == {0: "raised", 1: ["zero", "one", "kept"]}


def _in_a_subgroup(rank: int, world: int) -> dict[str, Any] | None:
    """Global ranks 1 and 2 form a subgroup; roots are named by global rank or by group rank."""
    import shoal.distributed as dist

    group = dist.new_group([1, 2])
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    by_global = [f"from {rank}"]
    dist.broadcast_object_list(by_global, src=2, group=group)
    by_group_rank = [f"from {rank}"]
    dist.broadcast_object_list(by_group_rank, group=group, group_src=0)  # group rank 0: global rank 1
    gathered = [None, None] if rank == 1 else None
    dist.gather_object(rank * 10, gathered, group=group, group_dst=0)
    return {"by_global": by_global, "by_group_rank": by_group_rank, "gathered": gathered}


def test_object_collectives_in_a_subgroup_take_global_or_group_ranks() -> None:
    assert run_ranks(_in_a_subgroup, 3) == {
        0: None,
        1: {"by_global": ["from 2"], "by_group_rank": ["from 1"], "gathered": [10, 20]},
        2: {"by_global": ["from 2"], "by_group_rank": ["from 1"], "gathered": None},
    }
