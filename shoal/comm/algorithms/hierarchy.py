"""The all-reduce, all-gather and reduce-scatter of a group whose ranks share some hosts and not others:
each host's share crosses the network once. Where every host has the same number of ranks, every rank
talks to other hosts, with its own part (a stream per place in a host); otherwise only in the all-reduce,
and only the first rank of each host (its leader) does.

All-reduce: each host reduce-scatters in its arena (intrahost.py), the j-th ranks of all hosts all-reduce
their share over the ring, and each host all-gathers the shares in its arena; on uneven hosts, each host
reduces in its arena, the leaders all-reduce over the ring, and each host broadcasts the result. The
tensor goes in pieces, so that while the network carries one piece the hosts reduce the next and gather
or broadcast the one before: where the network is the limit, the operation takes about as long as its
bytes on the network alone, where one step after another it would take that plus two passes over the
whole tensor in memory. Split over the places, a host's bytes cross in as many streams, sent and reduced
by as many processes: faster where one process cannot fill the link (docs/benchmarks.md, "Across two
hosts").
"""

from __future__ import annotations

import itertools
import math

import torch

from shoal.comm.algorithms import intrahost, ring
from shoal.comm.algorithms.placement import Placement, Subchannel
from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.algorithms.segments import Segments

PIECE_BYTES = 4 << 20
_IN_FLIGHT = 2  # pieces on the network at once: the one finishing and the one just started


def all_reduce(ch: ring.Channel, placement: Placement, flat: torch.Tensor, op: ReduceOp) -> None:
    """Reduce `flat` with `op` over every rank of the group (AVG is the caller's to divide). Runs in the
    arena's care where this host has one, so that a failure on the network frees its ranks waiting there."""
    if even(placement):
        _all_reduce_by_places(ch, placement, flat, op)
    else:
        _all_reduce_through_leaders(ch, placement, flat, op)


def _all_reduce_by_places(ch: ring.Channel, placement: Placement, flat: torch.Tensor, op: ReduceOp) -> None:
    arena, hosts = placement.arena, placement.hosts
    host, place, between = _seat(ch.rank, hosts)
    count = _pieces(flat.numel() * flat.element_size())
    cuts = list(itertools.pairwise(ring.split(flat.numel(), count)))

    def shares(k: int) -> list[torch.Tensor]:
        """Piece k cut into one share per place (the first shares one element longer where it does not
        divide), reduced in place."""
        a, b = cuts[k]
        return [flat[a + x:a + y] for x, y in itertools.pairwise(ring.split(b - a, len(host)))]

    # Each piece in flight has frame numbers and scratch memory of its own. The first share is the longest
    # and takes the most frames, but a share an element shorter may be small enough for the direct
    # exchange, whose scratch holds every host's share.
    largest, smallest = shares(0)[0], shares(count - 1)[-1]
    span = ring.frames(len(hosts), largest)
    size = max(ring.scratch_bytes(len(hosts), largest), ring.scratch_bytes(len(hosts), smallest))
    scratch = ch.scratch(min(count, _IN_FLIGHT) * size)
    receives: list[list] = []
    for k in range(count + 1):
        if k < count:
            ours = shares(k)
            intrahost.reduce_scatter(arena, ours[place], ours, op)
            between_hosts = Subchannel(ch, between, k * span, scratch[k % _IN_FLIGHT * size:][:size])
            receives.append(_start_all_reduce(between_hosts, ours[place], op))
        if k > 0:
            for handle in receives[k - 1]:
                ch.wait(handle)
            done = shares(k - 1)
            intrahost.all_gather(arena, done, done[place])
    ch.flush()  # our last sends may still read `flat`


def _start_all_reduce(between: Subchannel, piece: torch.Tensor, op: ReduceOp) -> list:
    """Start the all-reduce of `piece` between hosts: none left to wait for where it is small (one round of
    direct exchange, done here)."""
    if piece.numel() * piece.element_size() <= ring.SMALL_BYTES:
        ring.all_reduce(between, piece, op)
        return []
    return ring.start_all_reduce(between, piece, op)


def _all_reduce_through_leaders(ch: ring.Channel, placement: Placement, flat: torch.Tensor, op: ReduceOp) -> None:
    arena, leaders = placement.arena, placement.leaders
    count = _pieces(flat.numel() * flat.element_size())
    pieces = [flat[a:b] for a, b in itertools.pairwise(ring.split(flat.numel(), count))]
    leading = ch.rank in leaders
    if leading:  # each piece in flight has frame numbers and scratch memory of its own
        span, share = ring.frames(len(leaders), pieces[0]), ring.scratch_bytes(len(leaders), pieces[0])
        scratch = ch.scratch(min(count, _IN_FLIGHT) * share)
    receives: list[list] = []
    for k in range(count + 1):
        if k < count:
            if arena is not None:
                intrahost.all_reduce(arena, Segments([pieces[k]]), op)
            if leading:
                between = Subchannel(ch, leaders, k * span, scratch[k % _IN_FLIGHT * share:][:share])
                receives.append(_start_all_reduce(between, pieces[k], op))
        if k > 0:
            if leading:
                for handle in receives[k - 1]:
                    ch.wait(handle)
            if arena is not None:
                intrahost.broadcast(arena, pieces[k - 1], 0)
    if leading:
        ch.flush()  # our last sends may still read `flat`


def _seat(rank: int, hosts: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], int, list[int]]:
    """`rank`'s host, its place in that host, and the ranks at that place on every host (its ring between
    hosts)."""
    host = next(h for h in hosts if rank in h)
    place = host.index(rank)
    return host, place, [h[place] for h in hosts]


def _pieces(nbytes: int) -> int:
    """How many pieces of about `PIECE_BYTES` an operation moving `nbytes` between hosts goes in."""
    return max(1, math.ceil(nbytes / PIECE_BYTES))


def even(placement: Placement) -> bool:
    """Whether the all-reduce goes by places and `all_gather` and `reduce_scatter` serve this group: hosts
    of one size (the rings between hosts carry one block per host), several ranks each (fewer, and the
    flat ring is as good)."""
    return len({len(host) for host in placement.hosts}) == 1 and len(placement.hosts[0]) > 1


def all_gather(ch: ring.Channel, placement: Placement, outs: list[torch.Tensor], mine: torch.Tensor) -> None:
    """All-gather: the j-th ranks of all hosts run a ring all-gather of their blocks, and each host then
    gathers, in its arena, what its ranks received. Where a flat ring of four crosses between two hosts
    with 3/4 of the output each way, this crosses with half, in one stream per place in a host. It goes
    in pieces, the hosts gathering one while the network carries the next, and runs in the arena's care
    (see `all_reduce`)."""
    arena, hosts = placement.arena, placement.hosts
    _, place, between = _seat(ch.rank, hosts)
    if outs[ch.rank].data_ptr() != mine.data_ptr():  # FSDP2 gathers from its place in the output itself
        outs[ch.rank].copy_(mine)
    count = _pieces(len(hosts) * mine.numel() * mine.element_size())
    cuts = list(itertools.pairwise(ring.split(mine.numel(), count)))
    span = ring.gather_frames(len(hosts), mine[:cuts[0][1]])  # the first piece is the largest
    receives: list[list] = []
    for k in range(count + 1):
        if k < count:
            a, b = cuts[k]
            between_hosts = Subchannel(ch, between, k * span)
            receives.append(ring.start_all_gather(between_hosts, [outs[host[place]][a:b] for host in hosts],
                                                  outs[ch.rank][a:b]))
        if k > 0:
            for handle in receives[k - 1]:
                ch.wait(handle)
            a, b = cuts[k - 1]
            for host in hosts:
                intrahost.all_gather(arena, [outs[rank][a:b] for rank in host], outs[host[place]][a:b])
    ch.flush()  # our last sends may still read `outs`


def reduce_scatter(ch: ring.Channel, placement: Placement, out: torch.Tensor, blocks: list[torch.Tensor],
                   op: ReduceOp, partials: torch.Tensor) -> None:
    """Reduce-scatter (AVG is the caller's to divide): in its arena, each host reduces the blocks bound for
    every host's j-th rank into its own j-th rank (`partials`: room for one block per host); the j-th
    ranks of all hosts then run a ring reduce-scatter over those partial sums. Where a flat ring of four
    crosses between two hosts with 3/4 of the input each way, this crosses with half, in one stream per
    place in a host. It goes in pieces, the network carrying one while the hosts reduce the next, and runs
    in the arena's care (see `all_reduce`)."""
    arena, hosts = placement.arena, placement.hosts
    between = _seat(ch.rank, hosts)[2]
    partial = [partials[i * out.numel():(i + 1) * out.numel()] for i in range(len(hosts))]
    count = _pieces(len(hosts) * out.numel() * out.element_size())
    cuts = list(itertools.pairwise(ring.split(out.numel(), count)))

    def reduce_within(a: int, b: int) -> None:
        for host, into in zip(hosts, partial, strict=True):
            intrahost.reduce_scatter(arena, into[a:b], [blocks[rank][a:b] for rank in host], op)

    if count == 1:  # one piece: the ring's own way (a direct exchange where it is small)
        reduce_within(0, out.numel())
        ring.reduce_scatter(Subchannel(ch, between), out, partial, op)
        return
    span, share = ring.scatter_needs(len(hosts), out[:cuts[0][1]])  # the first piece is the largest
    scratch = ch.scratch(_IN_FLIGHT * share)
    receives: list[list] = []
    for k in range(count + 1):
        if k < count:
            a, b = cuts[k]
            reduce_within(a, b)
            between_hosts = Subchannel(ch, between, k * span, scratch[k % _IN_FLIGHT * share:][:share])
            # Piece k + 2 receives into this piece's scratch while our sends of this one may still be going
            # out: they must read `partials`, which no later piece touches.
            receives.append(ring.start_reduce_scatter(between_hosts, out[a:b], [p[a:b] for p in partial], op,
                                                      spend_blocks=True))
        if k > 0:
            for handle in receives[k - 1]:
                ch.wait(handle)
    ch.flush()  # our last sends may still read `partials`
