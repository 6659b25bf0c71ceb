"""Python objects through a group's collectives and point-to-point (torch.distributed's `*_object*`
functions; the pickling and padding are in comm/objects.py). A root or peer is a global rank (`src`,
`dst`) or the group's own (`group_src`, `group_dst`); the collectives root at global rank 0 when given
neither, as in torch."""

from __future__ import annotations

from typing import Any

import torch

from shoal.comm import objects
from shoal.comm.api.world import _group, members_only, root
from shoal.comm.backends.group import ProcessGroup


@members_only()
def broadcast_object_list(object_list: list[Any], src: int | None = None, group: ProcessGroup | None = None,
                          device: torch.device | None = None, group_src: int | None = None) -> None:
    """`src`'s objects, pickled, in every rank's `object_list`."""
    group = _group(group)
    objects.broadcast_object_list(group, object_list, root(group, src, group_src, "src", default=0), device=device)


@members_only()
def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
    objects.all_gather_object(_group(group), object_list, obj)


@members_only()
def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: ProcessGroup | None = None, group_dst: int | None = None) -> None:
    group = _group(group)
    objects.gather_object(group, obj, object_gather_list, root(group, dst, group_dst, "dst", default=0))


@members_only()
def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: ProcessGroup | None = None,
                        group_src: int | None = None) -> None:
    group = _group(group)
    objects.scatter_object_list(group, scatter_object_output_list, scatter_object_input_list,
                                root(group, src, group_src, "src", default=0))


@members_only()
def send_object_list(object_list: list[Any], dst: int | None = None, group: ProcessGroup | None = None,
                     device: torch.device | None = None, group_dst: int | None = None, use_batch: bool = False) -> None:
    """Send `object_list` to `dst`, whose `recv_object_list` takes a list of the same length.
    `use_batch` is accepted as torch takes it (a batched send is what shoal's sends are anyway)."""
    group = _group(group)
    objects.send_object_list(group, object_list, root(group, dst, group_dst, "dst"), device=device)


@members_only(outside=-1)
def recv_object_list(object_list: list[Any], src: int | None = None, group: ProcessGroup | None = None,
                     device: torch.device | None = None, group_src: int | None = None, use_batch: bool = False) -> int:
    """Fill `object_list` with what `src` sent with `send_object_list`, or (neither `src` nor `group_src`
    given) what the first rank to send one sent; returns the sender's global rank, as torch does."""
    group = _group(group)
    sender = None if src is None and group_src is None else root(group, src, group_src, "src")
    return objects.recv_object_list(group, object_list, sender, device=device)
