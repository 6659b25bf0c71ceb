"""The default process group: how a process joins the job and leaves it, and which group a call
without `group=` runs on (`import shoal.distributed as dist`). Names and argument order follow
torch.distributed, so a script moves over by changing its import."""

from __future__ import annotations

import collections
import functools
import inspect
import os
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar
from urllib.parse import urlparse

import torch
import torch.distributed as tdist

from shoal import config
from shoal.comm import observing, rendezvous
from shoal.comm.as_torch import TorchGroup
from shoal.comm.as_torch import world as torch_world
from shoal.comm.backends.group import DEFAULT_TIMEOUT, ProcessGroup
from shoal.comm.backends.registry import check_backend, world_group
from shoal.comm.store import Store
from shoal.observe import timeline

T = TypeVar("T")

_world: ProcessGroup | None = None  # what shoal's init made (a world torch's init made is torch_world.shared())
_subgroups: list[ProcessGroup] = []
# How many named subgroups of each member list this process has made since init: the members of a group
# that only they create (new_group with use_local_synchronization, shrink_group, split_group) count alike,
# so the count tells apart two groups of the same ranks.
named_groups: collections.Counter[tuple[str | int, ...]] = collections.Counter()
default_pg_timeout = DEFAULT_TIMEOUT  # torch's name for the timeout a group gets when given none


def _forget_in_child() -> None:
    """A forked child starts with no groups, free to init its own: the parent's, which it still holds
    without their threads, refuse to work there (and their shutdown leaves the parent's links alone)."""
    global _world
    _world = None
    _subgroups.clear()  # in place: groups.py holds this list too
    named_groups.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class _WorldMeta(type):
    """`GroupMember.WORLD` and `group.WORLD`, as torch spells the default group: None before init."""

    @property
    def WORLD(cls) -> ProcessGroup | None:
        return default_group() if is_initialized() else None


class GroupMember(metaclass=_WorldMeta):
    """What `new_group` returns on ranks outside the group (NON_GROUP_MEMBER, as torch's does); the
    collectives, given it, warn and do nothing there, as torch's do."""

    NON_GROUP_MEMBER = -100


class group(metaclass=_WorldMeta):
    """torch's `dist.group.WORLD`."""


def is_non_member(group: object) -> bool:
    """Whether `group` is what `new_group` gave a rank it left out (GroupMember.NON_GROUP_MEMBER): torch's
    `_rank_not_in_group`. Neither a group object nor None (the default group) is one."""
    return isinstance(group, int) and group == GroupMember.NON_GROUP_MEMBER


def _timeout_from_env(default: timedelta) -> timedelta:
    seconds = config.SHOAL_TIMEOUT_S.get()
    return timedelta(seconds=seconds) if seconds is not None else default


def init_process_group(backend: str | None = None, init_method: str | None = None, timeout: timedelta | None = None,
                       world_size: int = -1, rank: int = -1, store: tdist.Store | None = None, group_name: str = "",
                       pg_options: object | None = None, device_id: torch.device | int | None = None,
                       _ranks: list[int] | None = None) -> None:
    """Join the job: rendezvous through `store`, or the store at `init_method` (env:// unless given:
    tcp://host:port, file://path, or a scheme registered with `register_rendezvous_handler`), then connect
    the ranks. `backend` defaults to "shoal"; rank and world size left at -1 come from the environment.

    `timeout` (default 5 minutes) bounds the rendezvous and every later operation (SHOAL_TIMEOUT_S
    overrides it). Where SHOAL_TRACE names a directory (`shoal run --trace DIR`), this process's timeline
    starts here. `device_id` and `group_name` are accepted as torch takes them; shoal's groups need no
    binding to a device, and torch ignores the name too.
    """
    global _world
    if _world is not None:
        raise RuntimeError("the default process group is already initialized; call destroy_process_group() first")
    backend = check_backend(_backend_name(backend))
    if pg_options is not None or _ranks is not None:
        raise ValueError("init_process_group: pg_options and _ranks are options of torch's own backends; "
                         "shoal's take none")
    if backend == "shoal" and torch_world.shared() is not None:
        return  # torch's init_process_group("shoal") brought the world up: shoal's calls use it, torch ends it
    timeout = _timeout_from_env(timeout or DEFAULT_TIMEOUT)
    if store is not None and init_method is not None:
        raise ValueError("init_process_group: give init_method or store, not both")
    timeline.start_from_environment()
    store, rank, world_size, host = _joined(store, init_method or "env://", rank, world_size, timeout)
    _world = world_group(backend, store, rank, world_size, timeout, host)
    _world.store = store
    observing.observe(_world)
    if backend == "shoal":
        torch_world.share(_world, store)


def _backend_name(backend: str | None) -> str:
    """shoal's backend for torch's spelling of one: None is "shoal"; "GLOO" and "cpu:gloo" are "gloo"."""
    if backend is None:
        return "shoal"
    names = {part.split(":")[-1].strip().lower() for part in str(backend).split(",")}
    if len(names) != 1:
        raise ValueError(f"backend {backend!r} names a backend per device; shoal runs one backend for all of "
                         f"a group's tensors: give one name")
    return names.pop()


def _joined(store: tdist.Store | None, init_method: str, rank: int, world_size: int,
            timeout: timedelta) -> tuple[Store, int, int, str]:
    """The store every rank has joined, this rank, the world size, and the store's host."""
    known = (None if rank == -1 else rank, None if world_size == -1 else world_size)
    if store is None and urlparse(init_method).scheme in ("env", "tcp"):
        endpoint = rendezvous.resolve(init_method, *known)
        return rendezvous.join(endpoint, timeout), endpoint.rank, endpoint.world_size, endpoint.host
    if store is None:
        store, rank, world_size = next(rendezvous.rendezvous(init_method, rank, world_size, timeout=timeout))
    elif None in known:
        raise ValueError("init_process_group(store=...) needs rank= and world_size=")
    joined = rendezvous.join_store(Store(store), None, rank, world_size, timeout)
    return joined, rank, world_size, rendezvous.store_host(store)


def destroy_process_group(group: ProcessGroup | TorchGroup | None = None) -> None:
    """Destroy one subgroup, or (no argument) every group of this process (and torch's default group, where
    shoal's init gave torch one)."""
    global _world
    if isinstance(group, TorchGroup):
        tdist.destroy_process_group(group)  # torch's own registry lets go of it too
        return
    if is_non_member(group):
        return  # a group this rank is not in, as torch takes it
    if group is not None and group is not _world:
        group.shutdown()
        if group in _subgroups:
            _subgroups.remove(group)
        return
    for sub in _subgroups:
        sub.shutdown()
    _subgroups.clear()
    named_groups.clear()
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
    if is_non_member(group):
        raise ValueError("this rank is not a member of the group (new_group gave it GroupMember.NON_GROUP_MEMBER)")
    if isinstance(group, tdist.ProcessGroup):
        raise TypeError(f"this group is torch's, on backend {group.name()!r}: shoal's functions take groups of "
                        f"backend 'shoal' (shoal's own, or torch's made with init_process_group('shoal'))")
    if group is not None:
        return group
    if _world is None and torch_world.shared() is None:
        raise RuntimeError("the default process group is not initialized; call shoal.distributed."
                           "init_process_group() first")
    return _world if _world is not None else torch_world.shared()


def members_only(outside: object = None) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A function that takes `group`, made to warn and return `outside` on a rank that `new_group` left out
    of the group (given GroupMember.NON_GROUP_MEMBER), as torch's functions do."""

    def decorate(fn: Callable[..., T]) -> Callable[..., T]:
        position = list(inspect.signature(fn).parameters).index("group")

        @functools.wraps(fn)
        def call(*args, **kwargs):
            given = args[position] if len(args) > position else kwargs.get("group")
            if is_non_member(given):
                warnings.warn(f"{fn.__name__} on global rank {get_rank()}, which is not a member of the given "
                              f"group: nothing to do", stacklevel=2)
                return outside
            return fn(*args, **kwargs)

        return call

    return decorate


def root(group: ProcessGroup, global_rank: int | None, group_rank: int | None, role: str,
         default: int | None = None) -> int:
    """The global rank an operation is rooted at (or a point-to-point peer), given as either rank (torch's
    `src`/`group_src`, `dst`/`group_dst`); `default`, a global rank, when neither is."""
    if global_rank is not None and group_rank is not None:
        raise ValueError(f"give {role}={global_rank} or group_{role}={group_rank}, not both")
    if group_rank is not None:
        if not 0 <= group_rank < group.size:
            raise ValueError(f"group_{role}={group_rank} is not a rank of this group of {group.size}")
        return group.ranks[group_rank]
    if global_rank is None and default is None:
        raise ValueError(f"give {role}= (a global rank) or group_{role}= (a rank of the group)")
    return default if global_rank is None else global_rank


def default_group() -> ProcessGroup:
    """The group `init_process_group` created (what `group=None` means everywhere)."""
    return _group(None)


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in `group`; -1 where it is not a member, as in torch."""
    if is_non_member(group):
        return -1
    return _group(group).rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    """The number of ranks in `group`; -1 where this process is not a member, as in torch."""
    if is_non_member(group):
        return -1
    return _group(group).size


def get_backend(group: ProcessGroup | None = None) -> str:
    return _group(group).backend


def get_backend_config(group: ProcessGroup | None = None) -> str:
    """Which backend runs each device's tensors in `group`, in torch's "device:backend" form: shoal's
    backend and gloo take tensors on any device (staged through host memory), NCCL GPU tensors only."""
    backend = get_backend(group)
    return "cuda:nccl" if backend == "nccl" else f"cpu:{backend},cuda:{backend}"


def get_pg_count() -> int:
    """How many process groups this process holds: the default one and its live subgroups."""
    return (1 if is_initialized() else 0) + len(_subgroups)
