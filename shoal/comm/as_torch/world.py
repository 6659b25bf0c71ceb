"""Backend "shoal" for torch.distributed, and the one world of shoal groups a process has.

A process has at most one shoal world group, whose transport connects it to every rank, whichever API
brought it up: torch's `init_process_group("shoal")` or shoal's own. The other API shares it: shoal's
init gives torch its default group over that world (torch's components that need one, its FSDP, DCP and
DeviceMesh, then find it), torch's default group made first is the world shoal's init takes, and every
group torch makes later (`new_group`, a DeviceMesh's dimensions) is a subgroup over the same transport."""

from __future__ import annotations

import functools
import hashlib

import torch.distributed as tdist

from shoal.comm import observing
from shoal.comm.as_torch.group import TorchGroup
from shoal.comm.backends.native import ShoalProcessGroup
from shoal.comm.store import Store
from shoal.observe import timeline

BACKEND = "shoal"
_world: ShoalProcessGroup | None = None
_made_by_torch = False  # torch's default group brought the world up, and takes it down


def register() -> None:
    """Make `torch.distributed.init_process_group("shoal")` (and "cpu:shoal,...") build shoal groups."""
    tdist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def shared() -> ShoalProcessGroup | None:
    """This process's shoal world group, if either API has brought one up."""
    return _world


def made_by_torch() -> bool:
    return _made_by_torch


def share(world: ShoalProcessGroup, store: Store) -> None:
    """Shoal's init brought `world` up: lend torch a default group over it, unless the script has
    initialized torch.distributed itself (then torch keeps its own, and only shoal's functions use ours)."""
    global _world
    _world = world
    if not tdist.is_initialized():
        tdist.init_process_group(BACKEND, store=tdist.PrefixStore(store.prefix + "torch/", store.raw),
                                 rank=world.rank, world_size=world.size, timeout=world.timeout)
        _lend_default_group()


def unshare(world: ShoalProcessGroup) -> None:
    """Shoal's destroy takes `world` down: torch's groups over it go first."""
    global _world
    _withdraw_default_group()
    _world = None


# The default group shoal lends torch must not stop a script that then initializes torch.distributed itself
# (say, on gloo beside shoal's groups): while it is lent, torch's init_process_group first takes it back.
_torch_init = None


def _lend_default_group() -> None:
    global _torch_init
    _torch_init = original = tdist.init_process_group

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        _withdraw_default_group()
        return original(*args, **kwargs)

    tdist.init_process_group = tdist.distributed_c10d.init_process_group = init_process_group


def _withdraw_default_group() -> None:
    """Destroy torch's groups over our world, if torch's default group is still the one we lent."""
    global _torch_init
    if _torch_init is None:
        return
    tdist.init_process_group = tdist.distributed_c10d.init_process_group = _torch_init
    _torch_init = None
    if tdist.is_initialized() and _wraps(tdist.distributed_c10d._get_default_group(), _world):
        tdist.destroy_process_group()


def _wraps(group: tdist.ProcessGroup, world: ShoalProcessGroup) -> bool:
    return isinstance(group, TorchGroup) and group.shoal_group is world


def _create(options, _backend_options) -> TorchGroup:
    """torch's creator for backend "shoal": its default group (no member list) is the world, every other
    group a subgroup of the world. Called on member ranks only, with the group's own prefix of torch's store."""
    global _world, _made_by_torch
    members = list(options.global_ranks_in_group)
    if not members:
        if _world is not None:
            if (_world.rank, _world.size) != (options.group_rank, options.group_size):
                raise RuntimeError(f"torch's default group is rank {options.group_rank} of {options.group_size} "
                                   f"but this process's shoal world is rank {_world.rank} of {_world.size}")
            return TorchGroup(_world, release=lambda: None)  # shoal's destroy takes it down
        timeline.start_from_environment()
        world = ShoalProcessGroup.create(Store(options.store), options.group_rank, options.group_size,
                                         options.timeout, _store_host(options.store))
        _world, _made_by_torch = world, True
        observing.observe(world)
        return TorchGroup(world, release=lambda: _take_down(world))
    if _world is None:
        raise RuntimeError("torch is making a group on backend 'shoal' but this process has no shoal world group: "
                           "call init_process_group('shoal') first")
    subgroup = _world.subgroup(members, _group_id(options.group_id), options.timeout)
    return TorchGroup(subgroup, release=subgroup.shutdown)


def _take_down(world: ShoalProcessGroup) -> None:
    global _world, _made_by_torch
    world.shutdown()
    if _world is world:
        _world, _made_by_torch = None, False


def _group_id(name: str) -> int:
    """The id the frames of torch's group `name` carry: drawn from the name, which torch gives alike on
    every member; the top bit keeps it apart from the small ids shoal's own subgroups count up."""
    digest = hashlib.blake2b(name.encode(), digest_size=4).digest()  # frames carry 32 bits
    return int.from_bytes(digest, "big") | (1 << 31)


def _store_host(store: tdist.Store) -> str:
    """The host of the TCPStore under torch's prefixes: the interface that reaches it is the one peers can
    reach (loopback for the in-process stores)."""
    while isinstance(store, tdist.PrefixStore):
        store = store.underlying_store
    return store.host if isinstance(store, tdist.TCPStore) else "127.0.0.1"

