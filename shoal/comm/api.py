"""torch.distributed-style module functions over a default process group (`import shoal.distributed as dist`).

Names and argument order follow torch.distributed, so a script moves over by changing its import.
Ranks in `src`/`dst` arguments are global ranks, even with a subgroup, as in torch.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from shoal import config
from shoal.comm import objects, observing, rendezvous
from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.as_torch import TorchGroup
from shoal.comm.as_torch import world as torch_world
from shoal.comm.backends.group import DEFAULT_TIMEOUT, ProcessGroup
from shoal.comm.backends.registry import check_backend, world_group
from shoal.comm.backends.work import Work
from shoal.observe import timeline

_world: ProcessGroup | None = None  # what shoal's init made (a world torch's init made is torch_world.shared())
_subgroups: list[ProcessGroup] = []


def _timeout_from_env(default: timedelta) -> timedelta:
    seconds = config.SHOAL_TIMEOUT_S.get()
    return timedelta(seconds=seconds) if seconds is not None else default


def init_process_group(backend: str = "shoal", init_method: str = "env://", rank: int | None = None,
                       world_size: int | None = None, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Join the job: rendezvous through the store at `init_method`, then connect the ranks.

    `timeout` bounds the rendezvous and every later operation (SHOAL_TIMEOUT_S overrides it). Where
    SHOAL_TRACE names a directory (`shoal run --trace DIR`), this process's timeline starts here.
    """
    global _world
    if _world is not None:
        raise RuntimeError("the default process group is already initialized; call destroy_process_group() first")
    check_backend(backend)
    if backend == "shoal" and torch_world.shared() is not None:
        return  # torch's init_process_group("shoal") brought the world up: shoal's calls use it, torch ends it
    timeout = _timeout_from_env(timeout)
    timeline.start_from_environment()
    endpoint = rendezvous.resolve(init_method, rank, world_size)
    store = rendezvous.join(endpoint, timeout)
    _world = world_group(backend, store, endpoint.rank, endpoint.world_size, timeout, endpoint.host)
    _world.store = store
    observing.observe(_world)
    if backend == "shoal":
        torch_world.share(_world, store)


def destroy_process_group(group: ProcessGroup | TorchGroup | None = None) -> None:
    """Destroy one subgroup, or (no argument) every group of this process (and torch's default group, where
    shoal's init gave torch one)."""
    global _world
    if isinstance(group, TorchGroup):
        tdist.destroy_process_group(group)  # torch's own registry lets go of it too
        return
    if group is not None and group is not _world:
        group.shutdown()
        if group in _subgroups:
            _subgroups.remove(group)
        return
    for sub in _subgroups:
        sub.shutdown()
    _subgroups.clear()
    if _world is not None:
        world, _world = _world, None
        if world.backend == "shoal":
            torch_world.unshare()
        world.shutdown()


def is_initialized() -> bool:
    return _world is not None or torch_world.shared() is not None


def _group(group: ProcessGroup | tdist.ProcessGroup | None) -> ProcessGroup:
    """The shoal group a call runs on: the one given (a group torch made on backend "shoal" is one), else
    the default group, which torch's init_process_group("shoal") may have brought up."""
    if isinstance(group, TorchGroup):
        return group.shoal_group
    if isinstance(group, tdist.ProcessGroup):
        raise TypeError(f"this group is torch's, on backend {group.name()!r}: shoal's functions take groups of "
                        f"backend 'shoal' (shoal's own, or torch's made with init_process_group('shoal'))")
    if group is not None:
        return group
    if _world is None and torch_world.shared() is None:
        raise RuntimeError("the default process group is not initialized; call shoal.distributed."
                           "init_process_group() first")
    return _world if _world is not None else torch_world.shared()


def default_group() -> ProcessGroup:
    """The group `init_process_group` created (what `group=None` means everywhere)."""
    return _group(None)


def get_rank(group: ProcessGroup | None = None) -> int:
    return _group(group).rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    return _group(group).size


def get_backend(group: ProcessGroup | None = None) -> str:
    return _group(group).backend


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


def _finish(work: Work, async_op: bool) -> Work | None:
    if async_op:
        return work
    work.wait()
    return None


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    return _finish(_group(group).all_reduce(tensor, op, async_op=async_op), async_op)


def all_reduce_coalesced(tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
                         async_op: bool = False) -> Work | None:
    return _finish(_group(group).all_reduce_coalesced(tensors, op, async_op=async_op), async_op)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None,
              async_op: bool = False) -> Work | None:
    return _finish(_group(group).broadcast(tensor, src, async_op=async_op), async_op)


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
           async_op: bool = False) -> Work | None:
    return _finish(_group(group).reduce(tensor, dst, op, async_op=async_op), async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    return _finish(_group(group).all_gather(tensor_list, tensor, async_op=async_op), async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    return _finish(_group(group).gather(tensor, gather_list, dst, async_op=async_op), async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    return _finish(_group(group).scatter(tensor, scatter_list, src, async_op=async_op), async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                   group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    return _finish(_group(group).reduce_scatter(output, input_list, op, async_op=async_op), async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    return _finish(_group(group).all_to_all(output_tensor_list, input_tensor_list, async_op=async_op), async_op)


def barrier(group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    return _finish(_group(group).barrier(async_op=async_op), async_op)


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


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    _group(group).send(tensor, dst, tag, async_op=False).wait()


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, tag: int = 0) -> int:
    """Receive into `tensor` from `src`; returns `src`, as torch's recv returns the sender."""
    _group(group).recv(tensor, src, tag, async_op=False).wait()
    return src


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> Work:
    return _group(group).send(tensor, dst, tag)


def irecv(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, tag: int = 0) -> Work:
    return _group(group).recv(tensor, src, tag)
