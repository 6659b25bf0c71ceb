"""How far each rank's clock is from rank 0's, so that traces of several hosts line up (Cristian's
algorithm: ask rank 0 the time, and assume the answer was read halfway through the round trip)."""

from __future__ import annotations

import torch

from shoal.comm.backends.group import ProcessGroup
from shoal.observe import events

_TAG = 0x7C10C  # apart from the small tags programs use for their own send/recv
_ROUNDS = 8


def offset_to_rank0(group: ProcessGroup) -> int:
    """Nanoseconds to add to this rank's `events.wall_ns()` to read rank 0's; every rank must call it.

    The round trip with the least delay wins. An offset smaller than half that round trip cannot be
    told from none (ranks on one host share a clock), so it is taken as 0.
    """
    if group.size == 1:
        return 0
    stamp = torch.zeros(1, dtype=torch.int64)
    root = group.ranks[0]
    if group.rank == 0:
        for peer in group.ranks[1:]:
            for _ in range(_ROUNDS):
                group.recv(stamp, peer, _TAG).wait()
                stamp[0] = events.wall_ns()
                group.send(stamp, peer, _TAG).wait()
        return 0
    best_delay, offset = None, 0
    for _ in range(_ROUNDS):
        asked = events.wall_ns()
        stamp[0] = asked
        group.send(stamp, root, _TAG).wait()
        group.recv(stamp, root, _TAG).wait()
        answered = events.wall_ns()
        delay = answered - asked
        if best_delay is None or delay < best_delay:
            best_delay, offset = delay, int(stamp[0]) - (asked + answered) // 2
    return offset if abs(offset) > best_delay // 2 else 0
