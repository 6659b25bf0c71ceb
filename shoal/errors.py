"""Exceptions shared by every layer: a dead peer, a collective the ranks disagree on."""

from __future__ import annotations

from torch.distributed import DistBackendError


class PeerFailure(DistBackendError):
    """A peer process died or its connection dropped while this rank depended on it. A DistBackendError
    (a RuntimeError), so code written against torch.distributed catches it where it catches torch's."""

    def __init__(self, rank: int | None, detail: str = "") -> None:
        self.rank = rank
        self.detail = detail
        who = f"rank {rank}" if rank is not None else "a peer"
        super().__init__(f"{who} failed: {detail}" if detail else f"{who} failed")

    def __reduce__(self):
        # Keep the fields when the exception crosses a process boundary (pickled by a test helper).
        return (type(self), (self.rank, self.detail))


class CollectiveMismatchError(ValueError):
    """Ranks called the same collective with different tensors (numel, dtype) or arguments."""


class GroupBrokenError(DistBackendError):
    """A process group is unusable because an earlier operation on it failed."""
