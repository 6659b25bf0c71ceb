"""Backend "shoal" for torch.distributed, and the one world of shoal groups a process has.

A process has at most one shoal world group, whose transport connects it to every rank, whichever API
brought it up: torch's `init_process_group("shoal")` or shoal's own. The other API shares it: shoal's
init gives torch its default group over that world (torch's components that need one, its FSDP, DCP and
DeviceMesh, then find it), torch's default group made first is the world shoal's init takes, and every
group torch makes later (`new_group`, a DeviceMesh's dimensions) is a subgroup over the same transport."""

from __future__ import annotations

import functools
import os
import weakref

import torch.distributed as tdist

from shoal.comm import observing
from shoal.comm.as_torch.group import TorchGroup
from shoal.comm.backends.native import ShoalProcessGroup, named_group_id
from shoal.comm.rendezvous import store_host
from shoal.comm.store import Store
from shoal.observe import timeline

BACKEND = "shoal"
_world: ShoalProcessGroup | None = None
_torch_groups: weakref.WeakSet[TorchGroup] = weakref.WeakSet()  # torch's groups over `_world`, still alive
_ids_in_use: set[int] = set()  # the frame ids of torch's subgroups over `_world`


def _forget_in_child() -> None:
    """A forked child has no shoal world (comm/api/world.py); torch's groups it inherited refuse to work. A
    default group lent to torch stays torch's default until the child initializes either API, which takes
    it back first (`_lent` still names it)."""
    global _world, _torch_groups, _ids_in_use
    _world, _torch_groups, _ids_in_use = None, weakref.WeakSet(), set()


os.register_at_fork(after_in_child=_forget_in_child)


def register() -> None:
    """Make `torch.distributed.init_process_group("shoal")` build shoal groups."""
    tdist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def shared() -> ShoalProcessGroup | None:
    """This process's shoal world group, if either API has brought one up."""
    return _world


def share(world: ShoalProcessGroup, store: Store) -> None:
    """Shoal's init brought `world` up: lend torch a default group over it, unless the script has
    initialized torch.distributed itself (then torch keeps its own, and only shoal's functions use ours)."""
    global _world
    _withdraw_default_group()  # one lent by the process this one was forked from
    _world = world
    if not tdist.is_initialized():
        tdist.init_process_group(BACKEND, store=tdist.PrefixStore(store.prefix + "torch/", store.raw),
                                 rank=world.rank, world_size=world.size, timeout=world.timeout)
        _lend_default_group()


def unshare() -> None:
    """Shoal's destroy takes the world down: torch's groups over it go first (those torch still holds, a
    group made after it took the lent default group back, fail from then on as shut down)."""
    global _world
    _withdraw_default_group()
    for group in list(_torch_groups):
        group.shutdown()
    _world = None


# The default group shoal lends torch must not stop a script that then initializes torch.distributed itself
# (say, on gloo beside shoal's groups): while it is lent, torch's init_process_group first takes it back.
_torch_init = None
_lent: TorchGroup | None = None


def _lend_default_group() -> None:
    global _torch_init, _lent
    _lent = tdist.distributed_c10d._get_default_group()
    _torch_init = original = tdist.init_process_group

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        _withdraw_default_group()
        return original(*args, **kwargs)

    tdist.init_process_group = tdist.distributed_c10d.init_process_group = init_process_group


def _withdraw_default_group() -> None:
    """Destroy torch's groups over our world, if torch's default group is still the one we lent."""
    global _torch_init, _lent
    if _torch_init is None:
        return
    tdist.init_process_group = tdist.distributed_c10d.init_process_group = _torch_init
    lent, _torch_init, _lent = _lent, None, None
    if tdist.is_initialized() and tdist.distributed_c10d._get_default_group() is lent:
        tdist.destroy_process_group()


def _create(options, _backend_options) -> TorchGroup:
    """torch's creator for backend "shoal": its default group (no member list) is the world, every other
    group a subgroup of the world. Called on member ranks only, with the group's own prefix of torch's store."""
    global _world
    members = list(options.global_ranks_in_group)
    if not members:
        if _world is not None:
            if (_world.rank, _world.size) != (options.group_rank, options.group_size):
                raise RuntimeError(f"torch's default group is rank {options.group_rank} of {options.group_size} "
                                   f"but this process's shoal world is rank {_world.rank} of {_world.size}")
            # shoal's destroy takes it down
            return _made(TorchGroup(_world, lambda: None, options.store, options.timeout))
        timeline.start_from_environment()
        store = Store(options.store)
        world = ShoalProcessGroup.create(store, options.group_rank, options.group_size, options.timeout,
                                         store_host(options.store))
        world.store = store
        try:
            observing.observe(world)
        except BaseException:
            world.shutdown()
            raise
        _world = world
        return _made(TorchGroup(world, lambda: _take_down(world), options.store, options.timeout))
    if _world is None or members.index(_world.transport.rank) != options.group_rank:
        raise RuntimeError(f"torch is making a group of ranks {members} on backend 'shoal', but this process "
                           f"has no shoal world numbered as torch's: call init_process_group('shoal') first")
    group_id = named_group_id(options.group_id)
    if group_id in _ids_in_use:
        raise RuntimeError(f"torch's group {options.group_id!r} draws frame id {group_id:#x}, which a live group "
                           f"uses; destroy that group first")
    _ids_in_use.add(group_id)
    subgroup = _world.subgroup(members, group_id, options.timeout)

    def release() -> None:
        subgroup.shutdown()
        _ids_in_use.discard(group_id)

    return _made(TorchGroup(subgroup, release, options.store, options.timeout))


def _made(group: TorchGroup) -> TorchGroup:
    _torch_groups.add(group)
    return group


def _take_down(world: ShoalProcessGroup) -> None:
    global _world
    world.shutdown()
    if _world is world:
        _world = None
