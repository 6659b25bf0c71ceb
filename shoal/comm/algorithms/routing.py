"""The path each collective of a group takes, given where its ranks are (placement.py): shared memory
(intrahost.py) when they all share one host, the ring (ring.py) when no two do, and for an all-reduce in
a group that does both, a hierarchy (hierarchy.py): each host reduces in shared memory, rings between
hosts (one per place in a host, or the hosts' first ranks' where hosts differ in size) reduce across
them, and each host shares the result in shared memory; an all-gather and a reduce-scatter go through
shared memory and rings between hosts too, where the hosts have the same number of ranks. In such mixed
groups the other collectives keep the ring, as do reduce, gather, scatter and all-to-all everywhere
(`on_ring`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from shoal.comm.algorithms import hierarchy, intrahost, ring
from shoal.comm.algorithms.placement import Placement
from shoal.comm.algorithms.reduce_op import ReduceOp, finish_
from shoal.comm.algorithms.segments import Segments
from shoal.comm.shm.arena import Watch
from shoal.comm.transport.frames import Op


class OpChannel(ring.Channel, Watch, Protocol):
    """A ring channel that also knows its operation and watches it for the arena."""

    op: Op

    def packing(self, nbytes: int) -> torch.Tensor:
        """Memory, reused from op to op, to pack several tensors into one."""
        ...


_IN_SHARED_MEMORY = {"all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"}
_DIRECT = {"gather", "scatter", "all_to_all", "barrier"}


def path(name: str, placement: Placement | None, nbytes: int) -> str:
    """The path the functions below took for collective `name` of `nbytes`, as the timeline shows it."""
    if placement is None or (len(placement.hosts) == 1 and placement.arena is None):
        return "local"
    if placement.shared and name in _IN_SHARED_MEMORY:
        return "shared memory"
    if (name == "all_reduce" and not placement.apart) or (
            name in {"all_gather", "reduce_scatter"} and hierarchy.even(placement)):
        return "hierarchical"
    if name == "reduce_scatter":  # `nbytes` is its output; the ring decides by all of its input
        nbytes *= sum(len(host) for host in placement.hosts)
    small = nbytes <= ring.SMALL_BYTES and name in {"all_reduce", "broadcast", "reduce", "reduce_scatter"}
    return "direct" if small or name in _DIRECT else "ring"


def _in_arena(ch: OpChannel, placement: Placement, body: Callable[[], None]) -> None:
    placement.arena.run(ch.op, ch, body)


def on_ring(ch: OpChannel, placement: Placement, body: Callable[[], None]) -> None:
    """Run `body` over the transport; members of our arena waiting in it learn that we do."""
    if placement.arena is not None:
        placement.arena.announce(ch.op, ch)
    body()


def all_reduce(ch: OpChannel, placement: Placement, data: Segments, op: ReduceOp) -> None:
    arena = placement.arena
    if placement.shared:
        _in_arena(ch, placement, lambda: intrahost.all_reduce(arena, data, op))
        return
    if ch.size == 1:
        return
    flat = data.packed(ch.packing)  # the ring sends from one buffer
    if placement.apart:
        ring.all_reduce(ch, flat, op)  # no arena to tell
    else:
        partial = ReduceOp.SUM if op == ReduceOp.AVG else op  # divided once, by the whole group's size
        if arena is None:
            hierarchy.all_reduce(ch, placement, flat, partial)
        else:
            _in_arena(ch, placement, lambda: hierarchy.all_reduce(ch, placement, flat, partial))
        finish_(flat, op, ch.size)
    data.unpack(flat)


def broadcast(ch: OpChannel, placement: Placement, flat: torch.Tensor, root: int) -> None:
    if placement.shared:
        _in_arena(ch, placement, lambda: intrahost.broadcast(placement.arena, flat, root))
    else:
        on_ring(ch, placement, lambda: ring.broadcast(ch, flat, root))


def all_gather(ch: OpChannel, placement: Placement, outs: list[torch.Tensor], mine: torch.Tensor) -> None:
    if placement.shared:
        _in_arena(ch, placement, lambda: intrahost.all_gather(placement.arena, outs, mine))
    elif hierarchy.even(placement):
        _in_arena(ch, placement, lambda: hierarchy.all_gather(ch, placement, outs, mine))
    else:
        on_ring(ch, placement, lambda: ring.all_gather(ch, outs, mine))


def reduce_scatter(ch: OpChannel, placement: Placement, out: torch.Tensor, blocks: list[torch.Tensor],
                   op: ReduceOp) -> None:
    if placement.shared:
        _in_arena(ch, placement, lambda: intrahost.reduce_scatter(placement.arena, out, blocks, op))
    elif hierarchy.even(placement):
        partial = ReduceOp.SUM if op == ReduceOp.AVG else op  # divided once, by the whole group's size
        partials = ch.packing(len(placement.hosts) * out.nbytes).view(out.dtype)
        _in_arena(ch, placement, lambda: hierarchy.reduce_scatter(ch, placement, out, blocks, partial, partials))
        finish_(out, op, ch.size)
    else:
        on_ring(ch, placement, lambda: ring.reduce_scatter(ch, out, blocks, op))


def barrier(ch: OpChannel, placement: Placement) -> None:
    if placement.shared:
        _in_arena(ch, placement, lambda: intrahost.barrier(placement.arena))
    else:
        on_ring(ch, placement, lambda: ring.barrier(ch))
