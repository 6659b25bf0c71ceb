"""Point-to-point: a tensor from one rank to another, blocking or not, one at a time or in batches. The
peer is a global rank (`src`, `dst`) or the group's own (`group_src`, `group_dst`); a receive given neither
takes the first message with its tag from any rank."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.comm.api.world import _group, is_non_member, members_only, root
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.backends.work import Work


@members_only()
def send(tensor: torch.Tensor, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    group = _group(group)
    group.send(tensor, root(group, dst, group_dst, "dst"), tag, async_op=False).wait()


@members_only(outside=-1)
def recv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive into `tensor` from `src`, or from any rank when neither `src` nor `group_src` is given; returns
    the sender's global rank, as torch's recv does."""
    work = irecv(tensor, src, group, tag, group_src)
    work.wait()
    return work.source_rank() if src is None and group_src is None else root(_group(group), src, group_src, "src")


@members_only()
def isend(tensor: torch.Tensor, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
          group_dst: int | None = None) -> Work:
    group = _group(group)
    return group.send(tensor, root(group, dst, group_dst, "dst"), tag)


@members_only()
def irecv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
          group_src: int | None = None) -> Work:
    """Start a receive from `src`, or from any rank when neither `src` nor `group_src` is given (the Work's
    `source_rank()` then names it)."""
    group = _group(group)
    any_source = src is None and group_src is None
    return group.recv(tensor, None if any_source else root(group, src, group_src, "src"), tag)


@dataclass
class P2POp:
    """One send or receive of a `batch_isend_irecv`: `op` is `isend` or `irecv` (shoal's or torch's), `peer`
    a global rank or `group_peer` the group's own."""

    op: Callable
    tensor: torch.Tensor
    peer: int | None = None
    group: ProcessGroup | None = None
    tag: int = 0
    group_peer: int | None = None

    def __post_init__(self) -> None:
        if getattr(self.op, "__name__", None) not in ("isend", "irecv"):
            raise ValueError(f"P2POp: op must be isend or irecv, got {self.op!r}")
        if self.peer is not None and self.group_peer is not None:
            raise ValueError(f"P2POp: give peer={self.peer} or group_peer={self.group_peer}, not both")


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Start every send and receive of the list; their Works, in the list's order. The sends and receives
    of one pair of ranks match in the order each side lists them."""
    if not p2p_op_list or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError("batch_isend_irecv: give a non-empty list of P2POp")
    works = []
    for p in p2p_op_list:
        if is_non_member(p.group):
            raise ValueError("batch_isend_irecv: this rank is not a member of a P2POp's group")
        group = _group(p.group)
        peer = root(group, p.peer, p.group_peer, "peer")
        start = group.send if p.op.__name__ == "isend" else group.recv
        works.append(start(p.tensor, peer, p.tag))
    return works
