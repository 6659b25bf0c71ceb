"""The default process group: how a process joins the job and leaves it, and which group a call
without `group=` runs on (`import shoal.distributed as dist`). Names and argument order follow
torch.distributed, so a script moves over by changing its import."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as tdist

from shoal import config
from shoal.comm import observing, rendezvous
from shoal.comm.as_torch import TorchGroup
from shoal.comm.as_torch import world as torch_world
from shoal.comm.backends.group import DEFAULT_TIMEOUT, ProcessGroup
from shoal.comm.backends.registry import check_backend, world_group
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
