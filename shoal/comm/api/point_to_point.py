"""Point-to-point: a tensor from one rank to another, blocking or not."""

from __future__ import annotations

import torch

from shoal.comm.api.world import _group
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.backends.work import Work


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    _group(group).send(tensor, dst, tag, async_op=False).wait()


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, tag: int = 0) -> int:
    """Receive into `tensor` from `src`; returns `src`, as torch's recv returns the sender."""
    _group(group).recv(tensor, src, tag, async_op=False).wait()
    return src


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> Work:
    return _group(group).send(tensor, dst, tag)


def irecv(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, tag: int = 0) -> Work:
    return _group(group).recv(tensor, src, tag)
