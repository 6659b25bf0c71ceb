"""Python objects through a group's collectives (torch.distributed's `*_object*` functions; the
pickling and padding are in comm/objects.py)."""

from __future__ import annotations

from typing import Any

import torch

from shoal.comm import objects
from shoal.comm.api.world import _group
from shoal.comm.backends.group import ProcessGroup


def broadcast_object_list(object_list: list[Any], src: int | None = None, group: ProcessGroup | None = None,
                          device: torch.device | None = None, group_src: int | None = None) -> None:
    """`src`'s objects, pickled, in every rank's `object_list` (torch's; src defaults to rank 0)."""
    group = _group(group)
    objects.broadcast_object_list(group, object_list, _root(group, src, group_src, "src"), device=device)


def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
    objects.all_gather_object(_group(group), object_list, obj)


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: ProcessGroup | None = None, group_dst: int | None = None) -> None:
    group = _group(group)
    objects.gather_object(group, obj, object_gather_list, _root(group, dst, group_dst, "dst"))


def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: ProcessGroup | None = None,
                        group_src: int | None = None) -> None:
    group = _group(group)
    objects.scatter_object_list(group, scatter_object_output_list, scatter_object_input_list,
                                _root(group, src, group_src, "src"))


def _root(group: ProcessGroup, global_rank: int | None, group_rank: int | None, role: str) -> int:
    """The global rank an object collective is rooted at, given as either rank (torch's `src`/`group_src`);
    global rank 0 when neither is, as in torch."""
    if global_rank is not None and group_rank is not None:
        raise ValueError(f"give {role}={global_rank} or group_{role}={group_rank}, not both")
    if group_rank is None:
        return 0 if global_rank is None else global_rank
    if not 0 <= group_rank < group.size:
        raise ValueError(f"group_{role}={group_rank} is not a rank of this group of {group.size}")
    return group.ranks[group_rank]
