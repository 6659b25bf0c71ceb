"""Which ranks of a group share a host, found once per group over the group's own (authenticated)
connections, and the arena of shared memory (arena.py) the ranks of our host use from then on.

Every rank makes a region and announces it; its name carries the rank's host identity (the kernel's
boot id, or SHOAL_HOST_ID). Ranks that announce the same host try to map each other's regions, and say
which they could map. A host's ranks share an arena only if every one of them mapped every other (two
containers on one machine share a boot id but not their processes' memory): otherwise each stays on
its own, and the ring connects them. A rank with SHOAL_SHM=0 announces no region and is a host of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shoal.comm.algorithms import ring
from shoal.comm.shm import arena, futex, region
from shoal.comm.shm.arena import Arena
from shoal.comm.shm.region import Region

log = logging.getLogger(__name__)

_RECORD_BYTES = 256  # a region name (it carries the host), padded
# Discovery runs inside the group's first collective, in frames numbered where that collective's own
# ring frames never reach: its two exchanges from here, and from here plus _SECOND.
_DISCOVERY_SUB = 1 << 31
_SECOND = 1 << 30


@dataclass(frozen=True)
class Placement:
    """The hosts of a group: `hosts` holds group ranks, each host's sorted, hosts ordered by their first."""

    hosts: tuple[tuple[int, ...], ...]
    arena: Arena | None  # our host's, where it has ranks besides us

    @property
    def shared(self) -> bool:
        """Every rank of the group (and there are several) is in our arena."""
        return len(self.hosts) == 1 and self.arena is not None

    @property
    def apart(self) -> bool:
        """No two ranks share an arena: the ring does everything."""
        return all(len(host) == 1 for host in self.hosts)

    @property
    def leaders(self) -> list[int]:
        """The first rank of each host: the ranks that talk between hosts in an all-reduce where hosts differ
        in size."""
        return [host[0] for host in self.hosts]


def alone() -> Placement:
    return Placement(((0,),), None)


def discover(ch: ring.Channel, global_ranks: Sequence[int]) -> Placement:
    """Find the group's hosts; every rank of the group must call this in the same collective."""
    n, me = ch.size, ch.rank
    own = _own_region()
    try:
        announced = _exchange(Subchannel(ch, range(n), _DISCOVERY_SUB), own.name if own else "")
        hosts_of = [name.rpartition("/")[0] or None for name in announced]
        regions: dict[int, Region] = {} if own is None else {me: own}
        for rank, name in enumerate(announced):
            if rank != me and own is not None and hosts_of[rank] == hosts_of[me]:
                try:
                    regions[rank] = Region.open(name, arena.SIZE)
                except (OSError, ValueError):
                    pass  # not ours to share: another pid namespace, another user
        mapped = _exchange(Subchannel(ch, range(n), _DISCOVERY_SUB + _SECOND),
                           "".join("1" if r in regions else "0" for r in range(n)))
    finally:
        if own is not None:
            own.close_descriptor()  # everyone who could map it has
    hosts = group_hosts(hosts_of, [[flag == "1" for flag in row] for row in mapped])
    host = next(h for h in hosts if me in h)
    if len(host) == 1:
        return Placement(hosts, None)
    return Placement(hosts, Arena([regions[r] for r in host], [global_ranks[r] for r in host], host.index(me)))


def group_hosts(hosts_of: list[str | None], mapped: list[list[bool]]) -> tuple[tuple[int, ...], ...]:
    """Ranks by host: those announcing one host, if each mapped every other's region; the rest alone."""
    by_host: dict[str, list[int]] = {}
    hosts: list[tuple[int, ...]] = []
    for rank, host in enumerate(hosts_of):
        if host is None:
            hosts.append((rank,))
        else:
            by_host.setdefault(host, []).append(rank)
    for members in by_host.values():
        if all(mapped[a][b] for a in members for b in members if a != b):
            hosts.append(tuple(members))
        else:
            hosts.extend((rank,) for rank in members)
    return tuple(sorted(hosts))


class Subchannel:
    """Some ranks of a channel (`members`, in its ranks) as a channel of their own, with frame numbers
    shifted by `sub_base`: the ring algorithms run on it unchanged. Given `scratch`, it uses that
    memory rather than the channel's, so that two subchannels may run at once."""

    def __init__(self, ch: ring.Channel, members: Sequence[int], sub_base: int = 0,
                 scratch: torch.Tensor | None = None) -> None:
        self._ch, self._members, self._base, self._scratch = ch, list(members), sub_base, scratch
        self.rank, self.size = self._members.index(ch.rank), len(self._members)

    def recv(self, src: int, sub: int, view: memoryview, process: Callable[[], None] | None = None) -> object:
        return self._ch.recv(self._members[src], self._base + sub, view, process)

    def wait(self, handle: object) -> None:
        self._ch.wait(handle)

    def send(self, dst: int, sub: int, view: memoryview) -> None:
        self._ch.send(self._members[dst], self._base + sub, view)

    def flush(self) -> None:
        self._ch.flush()

    def scratch(self, nbytes: int) -> torch.Tensor:
        if self._scratch is None:
            return self._ch.scratch(nbytes)
        assert nbytes <= self._scratch.numel(), (nbytes, self._scratch.numel())
        return self._scratch[:nbytes]


def _exchange(ch: ring.Channel, text: str) -> list[str]:
    """Everyone's `text`, in rank order: at most _RECORD_BYTES of UTF-8, or one character per rank."""
    encoded = text.encode()
    size = max(_RECORD_BYTES, ch.size)
    assert len(encoded) <= size, text
    mine = torch.zeros(size, dtype=torch.uint8)
    mine[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    outs = [torch.empty_like(mine) for _ in range(ch.size)]
    ring.all_gather(ch, outs, mine)
    return [bytes(out.numpy()).rstrip(b"\0").decode() for out in outs]


def _own_region() -> Region | None:
    """Our region, or none where memory cannot be shared from here (then we are a host of our own:
    failing instead would leave the peers waiting for our announcement)."""
    if not (region.available() and futex.supported()):
        return None
    try:
        return arena.new_region()
    except OSError as exc:
        log.warning("no shared memory for this group's collectives (%s): they take the ring", exc)
        return None
