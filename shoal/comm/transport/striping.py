"""A collective's large frame striped over a pair's several connections (config.SHOAL_STREAMS): it goes as
parts, one to a connection, so that a network that caps each connection's rate carries it at the rate of
them all. Both ends cut a frame alike, from its size and the number of connections alone (which every
rank must give alike), so the receiver posts the parts the sender sends; which connection a part takes is
the sender's choice, as parts are matched by their numbers, not by where they arrive."""

from __future__ import annotations

import threading
from collections.abc import Callable

from shoal.comm.transport.frames import Recv

PART_MIN = 256 << 10  # smaller parts cost more in per-frame work than another connection's rate brings
# A part's number: the frame's own (below 2**24), its index, and how many parts the frame has, so that a
# receiver that cut a frame of another size into other parts takes none of them, not a prefix of the frame.
# It stays below 2**30, under the numbers placement.py exchanges its records by.
_SHIFT, _COUNT_SHIFT = 24, 27
_OWN = (1 << _SHIFT) - 1
_INDEX = (1 << (_COUNT_SHIFT - _SHIFT)) - 1
_PARTS_END = 1 << 30  # part_sub's numbers all lie below


def cuts(nbytes: int, streams: int) -> list[int]:
    """Offsets cutting a frame of `nbytes` into its parts: one part unless it is large and there are several
    connections."""
    parts = max(1, min(streams, nbytes // PART_MIN))
    return [nbytes * i // parts for i in range(parts + 1)]


def part_sub(sub: int, part: int, parts: int) -> int:
    """The number part `part` of the `parts` of frame `sub` goes under (a frame in one part, under its own)."""
    if parts == 1:
        return sub
    if sub > _OWN:
        raise ValueError(f"frame number {sub} is too large to be striped")
    return sub | part << _SHIFT | (parts - 1) << _COUNT_SHIFT


def first_parts_of_other_cuts(sub: int, streams: int) -> list[int]:
    """For the first part of a frame (or a frame in one part), the numbers the first part of the same frame
    goes under when cut into any other number of parts `streams` allows: where a sender and a receiver that
    disagree on the frame's size meet, rather than each waiting for parts the other never posts or sends."""
    if sub >= _PARTS_END or sub >> _SHIFT & _INDEX:
        return []
    own = sub & _OWN
    return [n for n in (part_sub(own, 0, parts) for parts in range(1, streams + 1)) if n != sub]


def spread(seq: int, sub: int) -> int:
    """Which of a pair's connections frame `sub` of operation `seq` goes on, modulo their number: an
    operation's frames, and a frame's parts, take them in turn."""
    return seq + (sub & _OWN) + (sub >> _SHIFT & _INDEX)


def gather(whole: Recv, parts: int) -> Callable[[Recv], None]:
    """The `on_done` of each of the `parts` receives of frame `whole`: the last to land, or the first to fail,
    finishes it (and so runs its `process`, on that part's reader thread)."""
    left = parts
    lock = threading.Lock()

    def part_done(part: Recv) -> None:
        nonlocal left
        with lock:
            left -= 1
            last = left == 0
        if part.error is not None or last:
            whole.finish(part.error)
    return part_done
