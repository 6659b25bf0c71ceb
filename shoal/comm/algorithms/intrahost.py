"""Collective algorithms for the ranks of one host, over their arena (arena.py): each rank writes its
contribution once into its own region, each reduces its share of the result straight out of everyone's
regions, and each copies the others' shares out. No byte crosses a socket, and ranks wait for each other
only where a round says they must (arena.py).

Tensors larger than a region go in rounds of at most `arena.INPUT_BYTES` per rank, so the data a peer
reads was written moments before and is still in the shared cache. All functions take flat, contiguous
CPU tensors (all_reduce: `Segments` of them) and run inside `Arena.run`.
"""

from __future__ import annotations

import torch

from shoal.comm.algorithms.reduce_op import ReduceOp, finish_, finish_into, reduce_into
from shoal.comm.algorithms.ring import SMALL_BYTES, split
from shoal.comm.algorithms.segments import Segments
from shoal.comm.shm.arena import INPUT_BYTES, Arena

__all__ = ["all_gather", "all_reduce", "barrier", "broadcast", "reduce_scatter"]


def _rounds(numel: int, per_round: int) -> range:
    """Where each round starts; an empty tensor still takes one round, so that ranks that disagree about
    the operation find out."""
    return range(0, max(numel, 1), per_round)


def all_reduce(arena: Arena, data: Segments, op: ReduceOp) -> None:
    """Small tensors: one round in which every rank reduces everything (in rank order, so all agree
    bitwise). Large: per round, rank r reduces shard r of the window and the others copy it out. The
    data is read and written where it lies, tensor by tensor."""
    n, me = arena.size, arena.me
    inputs = [arena.inputs(m).view(data.dtype) for m in range(n)]
    results = [arena.results(m).view(data.dtype) for m in range(n)]
    if data.nbytes <= SMALL_BYTES:
        arena.begin_round()
        everything = data.pieces(0, data.numel)
        for at, piece in everything:
            inputs[me][at:at + piece.numel()].copy_(piece)
        arena.post()
        for at, piece in everything:
            reduce_into(piece, [area[at:at + piece.numel()] for area in inputs], op)
            finish_(piece, op, n)
        arena.settle()
        return
    per_round = inputs[me].numel()
    for start in _rounds(data.numel, per_round):
        cuts = [start + cut for cut in split(min(per_round, data.numel - start), n)]
        lo, hi = cuts[me], cuts[me + 1]
        ours = data.pieces(lo, hi)
        arena.begin_round()
        for at, piece in data.pieces(start, lo) + data.pieces(hi, cuts[-1]):  # we reduce ours where it is
            inputs[me][at - start:at - start + piece.numel()].copy_(piece)
        arena.post()
        share = results[me]
        for at, piece in ours:
            parts = [piece if m == me else inputs[m][at - start:at - start + piece.numel()] for m in range(n)]
            reduce_into(share[at - lo:at - lo + piece.numel()], parts, op)
        arena.settle()
        # Each rank turns the shares (sums, for AVG) into means as it copies them out: the division
        # costs no pass of its own, and every rank divides the same sums.
        for at, piece in ours:
            finish_into(piece, share[at - lo:at - lo + piece.numel()], op, n)
        arena.wait_settled()  # every share is final
        for m in range(n):
            if m != me:
                for at, piece in data.pieces(cuts[m], cuts[m + 1]):
                    finish_into(piece, results[m][at - cuts[m]:at - cuts[m] + piece.numel()], op, n)


def broadcast(arena: Arena, flat: torch.Tensor, root: int) -> None:
    """`root` is the member index: the root writes a window, the others copy it out."""
    data = flat.view(torch.uint8)
    source = arena.inputs(root)
    for start in _rounds(data.numel(), INPUT_BYTES):
        piece = data[start:start + INPUT_BYTES]
        arena.begin_round()
        if arena.me == root:
            source[:piece.numel()].copy_(piece)
        arena.post()
        if arena.me != root:
            piece.copy_(source[:piece.numel()])
        arena.settle()


def all_gather(arena: Arena, outs: list[torch.Tensor], mine: torch.Tensor) -> None:
    """`outs` in member order; every rank writes its block and copies everyone else's. Blocks may differ
    in size, each the same on every rank."""
    n, me = arena.size, arena.me
    if outs[me].data_ptr() != mine.data_ptr():  # FSDP2 gathers from its place in the output itself
        outs[me].copy_(mine)
    data = mine.view(torch.uint8)
    targets = [out.view(torch.uint8) for out in outs]
    for start in _rounds(max(target.numel() for target in targets), INPUT_BYTES):
        piece = data[start:start + INPUT_BYTES]
        arena.begin_round()
        arena.inputs(me)[:piece.numel()].copy_(piece)
        arena.post()
        for m in range(n):
            if m != me:
                target = targets[m][start:start + INPUT_BYTES]
                target.copy_(arena.inputs(m)[:target.numel()])
        arena.settle()


def reduce_scatter(arena: Arena, out: torch.Tensor, blocks: list[torch.Tensor], op: ReduceOp) -> None:
    """`blocks` in member order, each the same size on every rank (ours the size of `out`); each rank's
    region holds a slot per destination, and rank r reduces slot r of every region into `out`."""
    n, me = arena.size, arena.me
    per_slot = INPUT_BYTES // n // out.element_size()
    slots = [[arena.inputs(m).view(out.dtype)[d * per_slot:(d + 1) * per_slot] for d in range(n)] for m in range(n)]
    for start in _rounds(max(block.numel() for block in blocks), per_slot):
        stop = min(start + per_slot, out.numel())
        arena.begin_round()
        for d in range(n):
            if d != me:
                piece = blocks[d][start:start + per_slot]
                slots[me][d][:piece.numel()].copy_(piece)
        arena.post()
        parts = [blocks[me][start:stop] if m == me else slots[m][me][:stop - start] for m in range(n)]
        if stop > start:
            reduce_into(out[start:stop], parts, op)
        arena.settle()
    finish_(out, op, n)


def barrier(arena: Arena) -> None:
    arena.begin_round()
    arena.post()
    arena.settle()
