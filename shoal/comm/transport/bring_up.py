"""How the members of a group bring up their mesh of authenticated links, the same way for process
groups and RPC: each listens on the interface that reaches the store (or on SHOAL_SOCKET_IFNAME's),
publishes its address under the group's part of the store (with a card: what else its peers should know
of it, such as an RPC name), reads everyone's, and then connects to every lower rank."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from shoal.comm.rendezvous import job_secret, listen_addresses
from shoal.comm.store import Store
from shoal.comm.transport.mesh import Transport


def listen(store: Store, rank: int, world_size: int, *, toward: str, timeout: timedelta,
           stall_timeout: timedelta, card: tuple[Any, ...] = (), open_membership: bool = False,
           streams: int = 1, every_interface: bool = True) -> tuple[Transport, list[list[Any]]]:
    """Our transport, listening and published, and every member's entry, [*card, hosts, port], in rank
    order (hosts: one address, or several joined by commas). `toward` is the store's host, toward which we
    listen (rendezvous.listen_addresses); without `every_interface`, on the first of SHOAL_SOCKET_IFNAME's
    interfaces only. With `open_membership`, ranks from `world_size` on may join later; `streams`
    connections join each pair (Transport), at least one for each of our addresses. The transport is closed
    if any step fails."""
    hosts = listen_addresses(toward)[:None if every_interface else 1]
    secret, session = job_secret(store, rank, hosts[0], timeout)
    transport = Transport(rank, world_size, secret=secret, session=session, hosts=hosts, stall_timeout=stall_timeout,
                          open_membership=open_membership, streams=max(streams, len(hosts)))
    try:
        store.set(f"members/{rank}", [*card, *transport.address])
        entries = [store.get(f"members/{r}", timeout=timeout) for r in range(world_size)]
        try:
            transport.check_addresses({r: entry[-2] for r, entry in enumerate(entries)})
        except ValueError:  # every rank sees it, in the same entries
            store.set(f"refused/{rank}", 1)
            if rank == 0:  # it may serve the store: stay until every rank has read the entries it refuses
                store.wait([f"refused/{r}" for r in range(world_size)], timeout=timeout)
            raise
    except BaseException:
        transport.close()
        raise
    return transport, entries


def connect(transport: Transport, entries: list[list[Any]], timeout: timedelta) -> None:
    """Connect to every lower rank and wait for every higher one (the caller closes the transport if
    this fails)."""
    transport.connect_mesh({r: (entries[r][-2], entries[r][-1]) for r in range(transport.rank)}, timeout)
