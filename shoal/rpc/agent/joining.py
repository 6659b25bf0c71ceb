"""How a worker joins an RPC group that is running: it finds the group's current start in the store,
claims a rank (the one it asks for, or the next free one after the group's first members) and its
name, registers, and dials every member: the first members and the workers that joined before it;
those that join after it dial it. The store's keys are listed in `members.py`."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from shoal.comm import rendezvous
from shoal.comm.store import Store

RUNNING = "shoal-rpc/running"  # in the store's root: the namespace of the group's current start
_MAX_RANK = 2**31 - 1  # ranks travel as int32 in the transport's handshake
_EARLIER_JOINER_S = 10.0  # how long an earlier joiner may take between drawing its place and naming its rank


def left(deadline: float) -> timedelta:
    """What is left of the join's time, as a store wait takes it (never 0, which c10d reads as no limit)."""
    return timedelta(seconds=max(0.001, deadline - time.monotonic()))


def find_group(host: str, port: int, deadline: float) -> tuple[Store, int, list[list[Any]]]:
    """The running group's part of the store at host:port, how many workers started it, and their
    entries ([name, host, port]), once every one of them is ready."""
    base = rendezvous.client(host, port, left(deadline))
    try:
        store = base.scoped(base.get(RUNNING, timeout=left(deadline)))
        world_size = store.get("joined/0", timeout=left(deadline))
        store.wait([f"ready/{rank}" for rank in range(world_size)], timeout=left(deadline))
    except TimeoutError:
        raise TimeoutError(f"init_rpc: no RPC group has started at {host}:{port} (waited until the init "
                           f"timeout); a worker without a world size joins a running group") from None
    return store, world_size, [store.get(f"members/{rank}", timeout=left(deadline)) for rank in range(world_size)]


def claim(store: Store, name: str, rank: int | None, world_size: int, entries: list[list[Any]]) -> int:
    """This worker's rank (`rank`, or without one the next that no worker holds), then its name,
    which no first member has and no other joiner has claimed."""
    if name in (entry[0] for entry in entries):
        raise ValueError(f"init_rpc: worker name {name!r} is taken in the running RPC group by rank "
                         f"{[entry[0] for entry in entries].index(name)}; every worker needs its own name")
    if rank is None:
        for _ in range(_MAX_RANK):  # each draw is a number no other joiner draws
            rank = world_size + store.add("drawn", 1) - 1
            if store.add(f"claims/{rank}", 1) == 1:
                break
    elif not 0 <= rank <= _MAX_RANK or store.add(f"claims/{rank}", 1) > 1:
        raise ValueError(f"init_rpc: rank {rank} is taken in the running RPC group (or is not a rank); "
                         f"leave rank out to be given a free one")
    claimant = store.compare_set(f"name-claims/{name}", rank)
    if claimant is None:  # released by a join that failed
        claimant = store.replace(f"name-claims/{name}", None, rank)
    if claimant != rank:
        store.add(f"claims/{rank}", -1)
        raise ValueError(f"init_rpc: worker name {name!r} is taken by another worker joining the running RPC "
                         f"group; every worker needs its own name")
    return rank


def release(store: Store, name: str, rank: int) -> None:
    """After a join that failed: its name is free again, for a worker that tries again (its rank is
    not: members it reached remember that rank as lost)."""
    store.replace(f"name-claims/{name}", rank, None)


def register(store: Store, rank: int, deadline: float) -> dict[int, list[Any]]:
    """Take this worker's place in the order of joiners (its entry, members/RANK, is already set);
    the entries of the workers that joined before it and have not left, by rank. One that died
    before naming its rank is passed over after a while."""
    place = store.add("joiners", 1) - 1
    store.set(f"joiner/{place}", rank)
    earlier = {}
    for number in range(place):
        wait = min(left(deadline), timedelta(seconds=_EARLIER_JOINER_S))
        try:
            other = store.get(f"joiner/{number}", timeout=wait)
        except TimeoutError:
            continue
        if not store.has(f"left/{other}"):
            earlier[other] = store.get(f"members/{other}", timeout=left(deadline))
    return earlier
