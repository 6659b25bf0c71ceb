"""How a worker joins an RPC group that is running: it finds the group in the store, claims its name
and a rank (the one it asks for, or the next free one after the group's first members), registers,
and dials every member, the first members and the workers that joined before it; those that join
after it dial it. The store's keys are listed in `members.py`."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from shoal.comm.store import Store


def running_world_size(store: Store, address: str, timeout: timedelta) -> int:
    """How many workers the running group started with, once all of them are ready."""
    try:
        world_size = store.get("joined/0", timeout=timeout)
        store.wait([f"ready/{rank}" for rank in range(world_size)], timeout=timeout)
        return world_size
    except TimeoutError:
        raise TimeoutError(f"init_rpc: no RPC group is running at {address} (waited "
                           f"{timeout.total_seconds():g} s); a worker joins a group without a world size, "
                           f"so the group must have started with one") from None


def claim_rank(store: Store, rank: int | None, world_size: int) -> int:
    """`rank`, or without one the next rank no worker holds."""
    if rank is None:
        while True:
            drawn = world_size + store.add("drawn", 1) - 1
            if store.add(f"claims/{drawn}", 1) == 1:
                return drawn
    if rank < 0 or store.add(f"claims/{rank}", 1) > 1:
        raise ValueError(f"init_rpc: rank {rank} is taken in the running RPC group; leave rank out to be "
                         f"given a free one")
    return rank


def register(store: Store, rank: int, timeout: timedelta) -> dict[int, list[Any]]:
    """Take this worker's place in the order of joiners (its entry, members/RANK, is already set);
    the entries of the workers that joined before it, by rank."""
    place = store.add("joiners", 1) - 1
    store.set(f"joiner/{place}", rank)
    earlier = [store.get(f"joiner/{n}", timeout=timeout) for n in range(place)]
    return {r: store.get(f"members/{r}", timeout=timeout) for r in earlier}


def claim_name(store: Store, name: str, world_size: int, timeout: timedelta) -> None:
    """`name` for this worker, before it registers anything: no first member's, nor any joiner's."""
    taken = [rank for rank in range(world_size) if store.get(f"members/{rank}", timeout=timeout)[0] == name]
    if taken or store.add(f"name-claims/{name}", 1) > 1:
        raise ValueError(f"init_rpc: worker name {name!r} is taken in the running RPC group"
                         f"{f' by rank {taken[0]}' if taken else ''}; every worker needs its own name, "
                         f"for the life of the group")
