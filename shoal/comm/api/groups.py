"""Subgroups of the default group (torch.distributed's `new_group` and its relatives)."""

from __future__ import annotations

from shoal.comm.api.world import _group, _subgroups
from shoal.comm.backends.group import ProcessGroup


def new_group(ranks: list[int] | None = None) -> ProcessGroup | None:
    """A subgroup of the given global ranks (sorted, as torch does). Every rank of the job must call
    it, in the same order; ranks outside the subgroup get None."""
    world = _group(None)
    members = sorted(set(range(world.size) if ranks is None else ranks))
    if ranks is not None and len(members) != len(ranks):
        raise ValueError(f"new_group: ranks {ranks} contain duplicates")
    if not members or members[0] < 0 or members[-1] >= world.size:
        raise ValueError(f"new_group: ranks {ranks} must be non-empty and within 0..{world.size - 1}")
    group = world.new_subgroup(members)
    if group is not None:
        _subgroups.append(group)
    return group
