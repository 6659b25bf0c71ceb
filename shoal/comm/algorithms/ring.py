"""Collective algorithms over point-to-point frames: pipelined ring reduce-scatter / all-gather for
large tensors, one-round direct exchange for small ones, chains and fan-outs for rooted collectives.

Every function works on flat, contiguous CPU tensors of the whole group and talks through a
`Channel` bound to one operation. Receives are posted before the matching sends go out, so frames
land in their final place without a copy; reductions are torch ops on whole chunks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Protocol

import torch

from shoal.comm.algorithms.reduce_op import ReduceOp, combine_, finish_, finish_into, reduce_into
from shoal.comm.shm.lanes import SLOT_BYTES
from shoal.comm.transport.frames import as_bytes

# Below this many bytes an all-reduce is one round of direct exchange: latency beats bandwidth.
SMALL_BYTES = 64 << 10
# Ring traffic moves in chunks of about this size so sending, receiving and reducing overlap;
# one chunk fills one shared-memory slot between ranks on a host.
CHUNK_BYTES = SLOT_BYTES


class Channel(Protocol):
    """What an algorithm needs from its process group for one operation (ranks are group ranks)."""

    rank: int
    size: int

    def recv(self, src: int, sub: int, view: memoryview, process: Callable[[], None] | None = None) -> object:
        """Post a receive; `process` runs (on a transport thread) as soon as the frame is in."""

    def wait(self, handle: object) -> None: ...

    def send(self, dst: int, sub: int, view: memoryview) -> None: ...

    def flush(self) -> None: ...

    def scratch(self, nbytes: int) -> torch.Tensor: ...


def split(total: int, parts: int) -> list[int]:
    """Offsets cutting `total` into `parts` runs whose lengths differ by at most one."""
    base, extra = divmod(total, parts)
    offsets = [0]
    for i in range(parts):
        offsets.append(offsets[-1] + base + (1 if i < extra else 0))
    return offsets


class _Layout:
    """Segments (one per rank) of a flat tensor, each cut into the same number of chunks."""

    def __init__(self, flat: torch.Tensor, bounds: list[int]) -> None:
        self.flat = flat
        self.bounds = bounds
        lengths = [b - a for a, b in itertools.pairwise(bounds)]
        self.max_segment = max(lengths)
        self.chunks = max(1, math.ceil(self.max_segment * flat.element_size() / CHUNK_BYTES))
        self._cuts = [split(n, self.chunks) for n in lengths]

    def segment(self, k: int) -> torch.Tensor:
        return self.flat[self.bounds[k]:self.bounds[k + 1]]

    def chunk(self, k: int, c: int, of: torch.Tensor | None = None) -> torch.Tensor:
        """Chunk c of segment k, taken from `of` (a segment-sized buffer) or from the flat tensor."""
        cut = self._cuts[k]
        base = self.segment(k) if of is None else of
        return base[cut[c]:cut[c + 1]]


def _ring_reduce_scatter(ch: Channel, layout: _Layout, op: ReduceOp,
                         on_reduced: Callable[[int, torch.Tensor], None] | None = None,
                         kept: tuple[list[torch.Tensor], torch.Tensor] | None = None, spend: bool = False) -> list:
    """Start a ring reduce-scatter; once the returned receives are done, segment `ch.rank` of the
    flat tensor holds the reduction over all ranks. With `kept` = (blocks, out), segment k's input is
    blocks[k] and is left as it is: partial reductions stay in scratch, and ours lands in `out`. With
    `spend` too, partial reductions go into the blocks instead, so that scratch only receives.

    Step s sends segment (rank-s-1) to the right and reduces segment (rank-s-2) from the left, a
    chunk at a time, as each chunk arrives; `on_reduced(c, chunk)` sees each chunk of our own
    segment as soon as it is final.
    """
    n, me, chunks = ch.size, ch.rank, layout.chunks
    right, left = (me + 1) % n, (me - 1) % n
    scratch = ch.scratch((n - 1) * layout.max_segment * layout.flat.element_size()).view(layout.flat.dtype)
    slots = [scratch[s * layout.max_segment:(s + 1) * layout.max_segment] for s in range(n - 1)]

    def own(k: int, c: int) -> torch.Tensor:
        """Chunk c of our input to segment k."""
        return layout.chunk(k, c) if kept is None else layout.chunk(k, c, kept[0][k])

    def reducer(s: int, c: int) -> Callable[[], None]:
        k = (me - s - 2) % n

        def process() -> None:
            received = layout.chunk(k, c, slots[s])
            if kept is None:
                reduced = own(k, c)
                combine_(reduced, received, op)
            elif s < n - 2:
                reduced, other = (own(k, c), received) if spend else (received, own(k, c))
                combine_(reduced, other, op)
            else:
                reduced = layout.chunk(k, c, kept[1])
                reduce_into(reduced, [own(k, c), received], op)
            if s < n - 2:
                ch.send(right, (s + 1) * chunks + c, as_bytes(reduced))
            elif on_reduced is not None:
                on_reduced(c, reduced)
        return process

    handles = [ch.recv(left, s * chunks + c, as_bytes(layout.chunk((me - s - 2) % n, c, slots[s])),
                       reducer(s, c)) for s in range(n - 1) for c in range(chunks)]
    for c in range(chunks):
        ch.send(right, c, as_bytes(own((me - 1) % n, c)))
    return handles


def _wait_all(ch: Channel, handles: list) -> None:
    for handle in handles:
        ch.wait(handle)


class _DirectReduce:
    """Contributions of every other rank received whole into scratch slots, then reduced with ours
    in rank order, so that every rank doing this computes bitwise the same result."""

    def __init__(self, ch: Channel, flat: torch.Tensor) -> None:
        self.ch, self.flat = ch, flat
        scratch = ch.scratch(flat.numel() * flat.element_size() * ch.size).view(flat.dtype)
        self.slots = [scratch[i * flat.numel():(i + 1) * flat.numel()] for i in range(ch.size)]
        self.handles = [ch.recv(src, 0, as_bytes(self.slots[src])) for src in range(ch.size) if src != ch.rank]

    def finish(self, op: ReduceOp) -> None:
        _wait_all(self.ch, self.handles)
        self.ch.flush()  # our own sends may read `flat`, which is overwritten below
        self.slots[self.ch.rank].copy_(self.flat)
        acc = self.slots[0]
        for slot in self.slots[1:]:
            combine_(acc, slot, op)
        self.flat.copy_(acc)
        finish_(self.flat, op, self.ch.size)


def all_reduce(ch: Channel, flat: torch.Tensor, op: ReduceOp) -> None:
    """Small tensors: one round of direct exchange. Large: ring reduce-scatter, then ring all-gather,
    chunk by chunk, each chunk starting its all-gather as soon as its reduction is final."""
    n, me = ch.size, ch.rank
    if n == 1:
        return
    if flat.numel() * flat.element_size() <= SMALL_BYTES:
        exchange = _DirectReduce(ch, flat)
        mine = as_bytes(flat)
        for dst in range(n):
            if dst != me:
                ch.send(dst, 0, mine)
        exchange.finish(op)
        return
    _wait_all(ch, start_all_reduce(ch, flat, op))
    ch.flush()


def start_all_reduce(ch: Channel, flat: torch.Tensor, op: ReduceOp) -> list:
    """Start the ring all-reduce of a tensor over SMALL_BYTES; once the returned receives are done, `flat`
    holds the result (our own sends may read it until `ch.flush()`). Its frames are numbered from 0 to
    `frames(ch.size, flat)`."""
    n, me = ch.size, ch.rank
    layout = _Layout(flat, split(flat.numel(), n))
    chunks, right, left = layout.chunks, (me + 1) % n, (me - 1) % n
    base = (n - 1) * chunks  # all-gather frames are numbered after the reduce-scatter ones

    def forward(s: int, c: int) -> Callable[[], None] | None:
        if s == n - 2:
            return None  # the last step's chunks have nowhere further to go
        chunk = layout.chunk((me - s - 1) % n, c)
        return lambda: ch.send(right, base + (s + 1) * chunks + c, as_bytes(chunk))

    gathered = [ch.recv(left, base + s * chunks + c, as_bytes(layout.chunk((me - s - 1) % n, c)), forward(s, c))
                for s in range(n - 1) for c in range(chunks)]

    def start_gather(c: int, chunk: torch.Tensor) -> None:
        finish_(chunk, op, n)
        ch.send(right, base + c, as_bytes(chunk))

    return _ring_reduce_scatter(ch, layout, op, start_gather) + gathered


def scratch_bytes(n: int, flat: torch.Tensor) -> int:
    """The scratch memory an all-reduce of `flat` over `n` ranks asks its channel for."""
    if flat.numel() * flat.element_size() <= SMALL_BYTES:
        return flat.numel() * flat.element_size() * n  # _DirectReduce's slots
    return (n - 1) * math.ceil(flat.numel() / n) * flat.element_size()  # _ring_reduce_scatter's


def frames(n: int, flat: torch.Tensor) -> int:
    """How many frame numbers `start_all_reduce` of `flat` over `n` ranks uses."""
    return 2 * (n - 1) * _Layout(flat, split(flat.numel(), n)).chunks


def gather_frames(n: int, mine: torch.Tensor) -> int:
    """How many frame numbers `start_all_gather` of blocks like `mine` over `n` ranks uses."""
    return (n - 1) * _Layout(mine, [0, mine.numel()]).chunks


def broadcast(ch: Channel, flat: torch.Tensor, root: int) -> None:
    """Small tensors fan out from the root; large ones flow down the chain root, root+1, ... in chunks."""
    n, me = ch.size, ch.rank
    if n == 1:
        return
    if flat.numel() * flat.element_size() <= SMALL_BYTES:
        if me == root:
            for dst in range(n):
                if dst != root:
                    ch.send(dst, 0, as_bytes(flat))
        else:
            ch.wait(ch.recv(root, 0, as_bytes(flat)))
        ch.flush()
        return
    layout = _Layout(flat, [0, flat.numel()])
    position = (me - root) % n
    nxt = (me + 1) % n if position < n - 1 else None
    if position == 0:
        for c in range(layout.chunks):
            ch.send(nxt, c, as_bytes(layout.chunk(0, c)))
    else:
        def forward(c: int) -> Callable[[], None] | None:
            view = as_bytes(layout.chunk(0, c))
            return None if nxt is None else lambda: ch.send(nxt, c, view)

        _wait_all(ch, [ch.recv((me - 1) % n, c, as_bytes(layout.chunk(0, c)), forward(c))
                       for c in range(layout.chunks)])
    ch.flush()


def reduce(ch: Channel, flat: torch.Tensor, op: ReduceOp, dst: int) -> None:
    """Only `dst`'s tensor receives the result; the others are left as they were."""
    n, me = ch.size, ch.rank
    if n == 1:
        return
    if flat.numel() * flat.element_size() <= SMALL_BYTES:
        if me == dst:
            _DirectReduce(ch, flat).finish(op)
        else:
            ch.send(dst, 0, as_bytes(flat))
            ch.flush()
        return
    work = flat if me == dst else flat.clone()
    layout = _Layout(work, split(work.numel(), n))
    base = (n - 1) * layout.chunks
    # Safe to post before the reduce-scatter: segment k can only come back from rank k after our
    # own contribution to it has been sent on.
    results = [ch.recv(k, base, as_bytes(layout.segment(k))) for k in range(n) if k != dst] if me == dst else []
    _wait_all(ch, _ring_reduce_scatter(ch, layout, op))
    finish_(layout.segment(me), op, n)
    if me != dst:
        ch.send(dst, base, as_bytes(layout.segment(me)))
    _wait_all(ch, results)
    ch.flush()


def reduce_scatter(ch: Channel, out: torch.Tensor, blocks: list[torch.Tensor], op: ReduceOp) -> None:
    """`out` on rank r gets the reduction over ranks of everyone's `blocks[r]`."""
    n, me = ch.size, ch.rank
    if n == 1 or out.numel() * out.element_size() * n <= SMALL_BYTES:
        exchange = _DirectReduce(ch, out)
        for dst in range(n):
            if dst != me:
                ch.send(dst, 0, as_bytes(blocks[dst]))
        out.copy_(blocks[me])
        exchange.finish(op)
        return
    # An output over a block we send would be overwritten while the send (or its resend) still reads it.
    result = torch.empty_like(out) if any(_overlap(out, b) for k, b in enumerate(blocks) if k != me) else out
    _wait_all(ch, start_reduce_scatter(ch, result, blocks, op))
    ch.flush()
    finish_into(out, result, op, n)


def _blocks_layout(n: int, out: torch.Tensor) -> _Layout:
    """The geometry of a reduce-scatter into `out`: the blocks stay where they are."""
    return _Layout(torch.empty(0, dtype=out.dtype), [i * out.numel() for i in range(n + 1)])


def start_reduce_scatter(ch: Channel, out: torch.Tensor, blocks: list[torch.Tensor], op: ReduceOp, *,
                         spend_blocks: bool = False) -> list:
    """Start the ring reduce-scatter of `blocks` (none over `out`) into `out`; once the returned receives
    are done, `out` holds the reduction, AVG not yet divided (our own sends may read the blocks, and over
    three ranks or more the channel's scratch, until `ch.flush()`). It uses `scatter_needs(ch.size, out)`
    frame numbers, from 0, and bytes of scratch.

    With `spend_blocks`, the blocks are the caller's to overwrite: partial sums go into them and are sent
    from there, so the scratch is free again once the receives are done, though our sends are not."""
    return _ring_reduce_scatter(ch, _blocks_layout(ch.size, out), op, kept=(blocks, out), spend=spend_blocks)


def scatter_needs(n: int, out: torch.Tensor) -> tuple[int, int]:
    """The frame numbers and the scratch bytes `start_reduce_scatter` into `out` over `n` ranks uses."""
    return (n - 1) * _blocks_layout(n, out).chunks, (n - 1) * out.numel() * out.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two flat tensors share any byte of memory."""
    a_end, b_end = a.data_ptr() + a.nbytes, b.data_ptr() + b.nbytes
    return a.nbytes > 0 and b.nbytes > 0 and a.data_ptr() < b_end and b.data_ptr() < a_end


def all_gather(ch: Channel, outs: list[torch.Tensor], mine: torch.Tensor) -> None:
    """Ring all-gather in chunks: step s passes block (rank-s) on to the right."""
    if outs[ch.rank].data_ptr() != mine.data_ptr():  # FSDP2 gathers from its place in the output itself
        outs[ch.rank].copy_(mine)
    if ch.size == 1:
        return
    _wait_all(ch, start_all_gather(ch, outs, mine))
    ch.flush()


def start_all_gather(ch: Channel, outs: list[torch.Tensor], mine: torch.Tensor) -> list:
    """Start the ring all-gather of `mine` (already in `outs[ch.rank]`, or that block itself) into `outs`;
    once the returned receives are done, so is the all-gather (our own sends may read the blocks until
    `ch.flush()`). It uses `gather_frames(ch.size, mine)` frame numbers, from 0."""
    n, me = ch.size, ch.rank
    whole = torch.empty(0, dtype=mine.dtype)  # only the chunk geometry is needed from the layout
    layout = _Layout(whole, [0, mine.numel()])
    chunks, right, left = layout.chunks, (me + 1) % n, (me - 1) % n

    def forward(s: int, c: int) -> Callable[[], None] | None:
        if s == n - 2:
            return None
        view = as_bytes(layout.chunk(0, c, outs[(me - s - 1) % n]))
        return lambda: ch.send(right, (s + 1) * chunks + c, view)

    handles = [ch.recv(left, s * chunks + c, as_bytes(layout.chunk(0, c, outs[(me - s - 1) % n])), forward(s, c))
               for s in range(n - 1) for c in range(chunks)]
    for c in range(chunks):
        ch.send(right, c, as_bytes(layout.chunk(0, c, mine)))
    return handles


def gather(ch: Channel, outs: list[torch.Tensor] | None, mine: torch.Tensor, dst: int) -> None:
    """Everyone sends straight to `dst`: it must receive every byte anyway."""
    if ch.rank != dst:
        ch.send(dst, 0, as_bytes(mine))
        ch.flush()
        return
    assert outs is not None
    handles = [ch.recv(src, 0, as_bytes(outs[src])) for src in range(ch.size) if src != dst]
    outs[dst].copy_(mine)
    _wait_all(ch, handles)


def scatter(ch: Channel, out: torch.Tensor, blocks: list[torch.Tensor] | None, src: int) -> None:
    """`src` sends each rank its block directly: it must send every byte anyway."""
    if ch.rank != src:
        ch.wait(ch.recv(src, 0, as_bytes(out)))
        return
    assert blocks is not None
    for dst in range(ch.size):
        if dst != src:
            ch.send(dst, 0, as_bytes(blocks[dst]))
    out.copy_(blocks[src])
    ch.flush()


def all_to_all(ch: Channel, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
    """Every pair exchanges its blocks directly; blocks may differ in size per pair."""
    me = ch.rank
    handles = [ch.recv(src, 0, as_bytes(outs[src])) for src in range(ch.size) if src != me]
    for dst in range(ch.size):
        if dst != me:
            ch.send(dst, 0, as_bytes(ins[dst]))
    outs[me].copy_(ins[me])
    _wait_all(ch, handles)
    ch.flush()


def barrier(ch: Channel) -> None:
    """Everyone tells everyone it has arrived; nobody leaves before hearing from all."""
    empty = memoryview(b"")
    handles = [ch.recv(src, 0, memoryview(bytearray(0))) for src in range(ch.size) if src != ch.rank]
    for dst in range(ch.size):
        if dst != ch.rank:
            ch.send(dst, 0, empty)
    _wait_all(ch, handles)
    ch.flush()
