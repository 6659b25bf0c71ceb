"""Subgroups (torch.distributed's `new_group` and its relatives) and the translation between a group's
ranks and the job's."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch

from shoal.comm.api.world import GroupMember, _group, _subgroups, get_rank, get_world_size, named_groups
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.backends.registry import check_backend

# torch's shrink_group flags: shoal cannot abort the parent's operations in flight, so it takes the default.
SHRINK_DEFAULT, SHRINK_ABORT = 0, 1


def new_group(ranks: Sequence[int] | None = None, timeout: timedelta | None = None, backend: str | None = None,
              pg_options: object | None = None, use_local_synchronization: bool = False,
              group_desc: str | None = None, device_id: torch.device | None = None,
              sort_ranks: bool = True) -> ProcessGroup | int | None:
    """A subgroup of the given global ranks (sorted unless `sort_ranks=False`), with its own `timeout`
    (the default group's otherwise). Every rank of the job calls it, in the same order, unless
    `use_local_synchronization`: then only the members need to. Ranks outside get
    `GroupMember.NON_GROUP_MEMBER` (None with `use_local_synchronization`), as in torch. `backend` may
    only name the default group's: shoal's subgroups run over the default group's connections.
    `group_desc` and `device_id` are accepted as torch takes them."""
    world = _group(None)
    if backend is not None and check_backend(str(backend).lower()) != world.backend:
        raise ValueError(f"new_group: backend {backend!r} differs from the default group's "
                         f"({world.backend!r}); shoal's subgroups run over the default group's connections")
    if pg_options is not None:
        raise ValueError("new_group: pg_options are options of torch's own backends; shoal's take none")
    members = _members(world, ranks, sort_ranks)
    if not use_local_synchronization:
        return _made(world.new_subgroup(members, timeout))
    if world.ranks[world.rank] not in members:
        return None
    return _made(world.new_subgroup(members, timeout, name=_name("local", members)))


def _name(kind: str, members: Sequence[int]) -> str:
    """The name of a group that only its members make: its kind, its ranks, and how many such groups of
    these ranks this process has made since init (its members count alike)."""
    key = (kind, *members)
    named_groups[key] += 1
    return f"shoal:{kind}:{','.join(map(str, members))}:{named_groups[key]}"


def _members(world: ProcessGroup, ranks: Sequence[int] | None, sort: bool) -> list[int]:
    members = list(range(world.size)) if ranks is None else list(ranks)
    if len(set(members)) != len(members):
        raise ValueError(f"new_group: ranks {list(ranks)} contain duplicates")
    if not members or min(members) < 0 or max(members) >= world.size:
        raise ValueError(f"new_group: ranks {ranks} must be non-empty and within 0..{world.size - 1}")
    return sorted(members) if sort else members


def _made(group: ProcessGroup | None) -> ProcessGroup | int:
    if group is None:
        return GroupMember.NON_GROUP_MEMBER
    _subgroups.append(group)
    return group


def new_subgroups(group_size: int | None = None, group: ProcessGroup | None = None,
                  timeout: timedelta | None = None, backend: str | None = None, pg_options: object | None = None,
                  group_desc: str | None = None) -> tuple[ProcessGroup, list[ProcessGroup | int]]:
    """Cut the job (or `group`'s ranks) into consecutive subgroups of `group_size` ranks (one per host's
    GPUs when not given, as torch does): (this rank's subgroup, all of them)."""
    ranks = list(range(get_world_size())) if group is None else list(_group(group).ranks)
    if group_size is None:
        if not torch.cuda.is_available():
            raise ValueError("new_subgroups: give group_size= (it defaults to the number of GPUs, and this "
                             "host has none)")
        group_size = torch.cuda.device_count()
    if group_size <= 0 or len(ranks) % group_size:
        raise ValueError(f"new_subgroups: group_size={group_size} must divide the {len(ranks)} ranks")
    return new_subgroups_by_enumeration([ranks[i:i + group_size] for i in range(0, len(ranks), group_size)],
                                        timeout, backend, pg_options, group_desc)


def new_subgroups_by_enumeration(ranks_per_subgroup_list: Sequence[Sequence[int]], timeout: timedelta | None = None,
                                 backend: str | None = None, pg_options: object | None = None,
                                 group_desc: str | None = None) -> tuple[ProcessGroup | None, list]:
    """One subgroup per list of global ranks (the lists must not overlap); every rank of the job calls it:
    (this rank's subgroup, or None, and all of them)."""
    if not ranks_per_subgroup_list:
        raise ValueError("new_subgroups_by_enumeration: give at least one list of ranks")
    seen: set[int] = set()
    for ranks in ranks_per_subgroup_list:
        if seen & set(ranks):
            raise ValueError(f"new_subgroups_by_enumeration: rank(s) {sorted(seen & set(ranks))} are in two "
                             f"subgroups")
        seen |= set(ranks)
    me, mine, made = get_rank(), None, []
    for ranks in ranks_per_subgroup_list:
        subgroup = new_group(ranks, timeout, backend, pg_options)
        made.append(subgroup)
        if me in ranks:
            mine = subgroup
    return mine, made


def split_group(parent_pg: ProcessGroup | None = None, split_ranks: list[list[int]] | None = None,
                timeout: timedelta | None = None, pg_options: object | None = None, group_desc: str | None = None,
                backend: str | None = None) -> ProcessGroup | None:
    """Split `parent_pg` (the default group) into disjoint groups given by *group* ranks of the parent;
    every rank of the parent, and only those, calls it. The group this rank is in, or None."""
    parent = _group(parent_pg)
    if not split_ranks:
        raise ValueError("split_group: split_ranks must list at least one group of the parent's ranks")
    if backend is not None and check_backend(str(backend).lower()) != parent.backend:
        raise ValueError(f"split_group: backend {backend!r} differs from the parent's ({parent.backend!r})")
    if pg_options is not None:
        raise ValueError("split_group: pg_options are options of torch's own backends; shoal's take none")
    every = [r for part in split_ranks for r in part]
    if len(set(every)) != len(every) or any(not 0 <= r < parent.size for r in every):
        raise ValueError(f"split_group: split_ranks={split_ranks} must be disjoint lists of the parent's ranks "
                         f"(0..{parent.size - 1})")
    mine = None
    for part in split_ranks:
        members = [parent.ranks[r] for r in part]
        # Only the parent's ranks call it: a name keeps the ranks outside the parent out of the count.
        subgroup = parent.new_subgroup(members, timeout, name=_name(f"split{list(parent.ranks)}", members))
        if subgroup is not None:
            _subgroups.append(subgroup)
            mine = subgroup
    return mine


def shrink_group(ranks_to_exclude: list[int], group: ProcessGroup | None = None, shrink_flags: int = 0,
                 pg_options: object | None = None) -> ProcessGroup:
    """A new group of `group`'s ranks but the excluded ones (group ranks), which only the remaining ranks
    call: the way on after losing peers. The default group cannot be shrunk here (torch would renumber the
    job's ranks); shrink a subgroup, or let `LiveTraining` re-form the job. Operations in flight on the
    parent are not aborted (SHRINK_ABORT is refused)."""
    if shrink_flags != SHRINK_DEFAULT or pg_options is not None:
        raise ValueError(f"shrink_group: shrink_flags={shrink_flags} and pg_options={pg_options!r}: shoal takes "
                         f"SHRINK_DEFAULT and no options (it cannot abort the parent's operations in flight)")
    if group is None or _group(group) is _group(None):
        raise ValueError("shrink_group: shoal shrinks subgroups only; the default group's ranks stay the job's "
                         "(LiveTraining re-forms the job after a loss)")
    parent = _group(group)
    excluded = set(ranks_to_exclude)
    if not excluded or len(excluded) != len(ranks_to_exclude) or not excluded <= set(range(parent.size)):
        raise ValueError(f"shrink_group: ranks_to_exclude={ranks_to_exclude} must be distinct ranks of the group "
                         f"(0..{parent.size - 1})")
    if parent.rank in excluded:
        raise RuntimeError(f"shrink_group: group rank {parent.rank} is excluded and must not call it")
    if len(excluded) == parent.size:
        raise ValueError("shrink_group: that excludes every rank")
    remaining = [r for i, r in enumerate(parent.ranks) if i not in excluded]
    return _made(parent.new_subgroup(remaining, name=_name("shrink", remaining)))


def get_process_group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of `group`'s members, in group-rank order."""
    return list(_group(group).ranks)


def get_global_rank(group: ProcessGroup, group_rank: int) -> int:
    """The job's rank of `group`'s member number `group_rank`."""
    ranks = _group(group).ranks
    if not 0 <= group_rank < len(ranks):
        raise ValueError(f"group rank {group_rank} is not in this group of {len(ranks)} ranks")
    return ranks[group_rank]


def get_group_rank(group: ProcessGroup, global_rank: int) -> int:
    """`global_rank`'s number within `group`."""
    return _group(group).group_rank(global_rank, "global_rank")
