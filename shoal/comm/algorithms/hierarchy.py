"""The all-reduce of a group whose ranks share some hosts and not others: each host reduces in its arena
(intrahost.py), the first rank of each host (its leader) all-reduces with the other hosts' leaders over
the ring, and each host broadcasts the result in its arena; only the leaders' bytes cross the network.

The tensor goes in pieces, so that while the network carries one piece the hosts reduce the next and
broadcast the one before: the operation takes about as long as the network's share alone, where one
piece after another it would take that plus two passes over the whole tensor in memory.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch

from shoal.comm.algorithms import intrahost, ring
from shoal.comm.algorithms.placement import Placement, Subchannel
from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.algorithms.segments import Segments

PIECE_BYTES = 4 << 20
_IN_FLIGHT = 2  # pieces on the network at once: the one finishing and the one just started


def all_reduce(ch: ring.Channel, placement: Placement, flat: torch.Tensor, op: ReduceOp,
               in_arena: Callable[[Callable[[], None]], None]) -> None:
    """Reduce `flat` with `op` over every rank of the group (AVG is the caller's to divide); `in_arena`
    runs a body in the arena's care, so that a failure in it frees the ranks waiting there."""
    arena, leaders = placement.arena, placement.leaders
    count = max(1, math.ceil(flat.numel() * flat.element_size() / PIECE_BYTES))
    pieces = [flat[a:b] for a, b in itertools.pairwise(ring.split(flat.numel(), count))]
    leading = ch.rank in leaders
    if leading:  # each piece in flight has frame numbers and scratch memory of its own
        span = ring.frames(len(leaders), pieces[0])
        share = pieces[0].numel() * flat.element_size() * len(leaders)  # the most a ring all-reduce asks
        scratch = ch.scratch(_IN_FLIGHT * share)
    receives: list[list] = []

    def start(k: int) -> None:
        between = Subchannel(ch, leaders, k * span, scratch[k % _IN_FLIGHT * share:][:share])
        if pieces[k].numel() * flat.element_size() <= ring.SMALL_BYTES:
            ring.all_reduce(between, pieces[k], op)  # one round of direct exchange, done here
            receives.append([])
        else:
            receives.append(ring.start_all_reduce(between, pieces[k], op))

    def finish(k: int) -> None:
        if leading:
            for handle in receives[k]:
                ch.wait(handle)
        if arena is not None:
            intrahost.broadcast(arena, pieces[k], 0)

    for k in range(count + 1):
        if k < count:
            if arena is not None:
                in_arena(lambda k=k: intrahost.all_reduce(arena, Segments([pieces[k]]), op))
            if leading:
                in_arena(lambda k=k: start(k))
        if k > 0:
            in_arena(lambda k=k: finish(k - 1))
    if leading:
        ch.flush()  # our last sends may still read `flat`
