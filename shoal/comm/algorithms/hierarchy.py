"""The all-reduce of a group whose ranks share some hosts and not others: each host reduces in its arena
(intrahost.py), the first rank of each host (its leader) all-reduces with the other hosts' leaders over
the ring, and each host broadcasts the result in its arena; only the leaders' bytes cross the network.

The tensor goes in pieces, so that while the network carries one piece the hosts reduce the next and
broadcast the one before: where the network is the limit, the operation takes about as long as its
bytes on the network alone, where one step after another it would take that plus two passes over the
whole tensor in memory.
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
    arena, leaders = placement.arena, placement.leaders
    count = max(1, math.ceil(flat.numel() * flat.element_size() / PIECE_BYTES))
    pieces = [flat[a:b] for a, b in itertools.pairwise(ring.split(flat.numel(), count))]
    leading = ch.rank in leaders
    if leading:  # each piece in flight has frame numbers and scratch memory of its own
        span, share = ring.frames(len(leaders), pieces[0]), ring.scratch_bytes(len(leaders), pieces[0])
        scratch = ch.scratch(min(count, _IN_FLIGHT) * share)
    receives: list[list] = []

    def start(k: int) -> None:
        between = Subchannel(ch, leaders, k * span, scratch[k % _IN_FLIGHT * share:][:share])
        if pieces[k].numel() * flat.element_size() <= ring.SMALL_BYTES:
            ring.all_reduce(between, pieces[k], op)  # one round of direct exchange, done here
            receives.append([])
        else:
            receives.append(ring.start_all_reduce(between, pieces[k], op))

    for k in range(count + 1):
        if k < count:
            if arena is not None:
                intrahost.all_reduce(arena, Segments([pieces[k]]), op)
            if leading:
                start(k)
        if k > 0:
            if leading:
                for handle in receives[k - 1]:
                    ch.wait(handle)
            if arena is not None:
                intrahost.broadcast(arena, pieces[k - 1], 0)
    if leading:
        ch.flush()  # our last sends may still read `flat`
