"""ProcessGroup: the collective and point-to-point API every backend offers, with the argument
checks they share. Backends implement the `_start_*` methods; every op returns a `Work`."""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence
from datetime import timedelta

import torch

from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.backends.work import AllOf, Work

DEFAULT_TIMEOUT = timedelta(minutes=5)


class ProcessGroup(abc.ABC):
    """A set of ranks that run collectives together. `ranks` are global ranks; `rank` is ours within."""

    backend: str = ""
    store: object | None = None  # the rendezvous store, kept alive (rank 0 serves it) with the group
    # Whether all_reduce_coalesced costs no more than all_reduce of one tensor: it works on the tensors
    # where they lie, or packs them into memory it reuses. Then a caller need not pack them itself.
    coalesces_for_free: bool = False

    def __init__(self, ranks: Sequence[int], global_rank: int, timeout: timedelta) -> None:
        self.ranks = tuple(ranks)
        self.rank = self.ranks.index(global_rank)
        self.size = len(self.ranks)
        self.timeout = timeout
        self.made_in = os.getpid()  # a process forked from this one holds the group without its threads

    @property
    def device(self) -> torch.device:
        """Where the group's own bookkeeping tensors (flags, lengths) live: NCCL moves GPU tensors only."""
        return torch.device("cpu")

    def failed_ranks(self) -> frozenset[int]:
        """Ranks of this group (ours, not global) known to be lost: their process is gone, or their
        connection could not be healed, or they fell silent past the heartbeat timeout. A backend that
        cannot tell (torch's engines report a failure only as an operation's error) finds none."""
        return frozenset()

    def group_rank(self, global_rank: int, role: str) -> int:
        """Translate a global rank (as torch.distributed's src/dst arguments are) into ours."""
        if global_rank not in self.ranks:
            raise ValueError(f"{role}={global_rank} is not a member of this group (ranks {list(self.ranks)})")
        return self.ranks.index(global_rank)

    # ---- public operations: check arguments, then let the backend start the op ----------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = True) -> Work:
        _check_tensor(tensor, "all_reduce")
        return self._start_all_reduce(tensor, _check_op(op, tensor.dtype, "all_reduce"), blocking=not async_op)

    def all_reduce_coalesced(self, tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM, *,
                             async_op: bool = True) -> Work:
        """All-reduce several tensors of one dtype, each in place, as one collective: that of their
        concatenation, which another rank may pass as one tensor or cut differently."""
        if not tensors:
            raise ValueError("all_reduce_coalesced: needs at least one tensor")
        for i, t in enumerate(tensors):
            _check_tensor(t, f"all_reduce_coalesced tensors[{i}]")
            if t.dtype != tensors[0].dtype or t.device != tensors[0].device:
                raise ValueError(f"all_reduce_coalesced: tensors[{i}] is {t.dtype} on {t.device} but tensors[0] "
                                 f"is {tensors[0].dtype} on {tensors[0].device}; they must match")
        return self._start_all_reduce_coalesced(list(tensors), _check_op(op, tensors[0].dtype, "all_reduce_coalesced"),
                                                blocking=not async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = True) -> Work:
        _check_tensor(tensor, "broadcast")
        return self._start_broadcast(tensor, self.group_rank(src, "src"), blocking=not async_op)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = True) -> Work:
        _check_tensor(tensor, "reduce")
        return self._start_reduce(tensor, self.group_rank(dst, "dst"), _check_op(op, tensor.dtype, "reduce"),
                                  blocking=not async_op)

    def all_gather(self, outs: list[torch.Tensor], tensor: torch.Tensor, *, async_op: bool = True) -> Work:
        _check_tensor(tensor, "all_gather")
        self._check_list(outs, "all_gather", "tensor_list", like=tensor)
        return self._start_all_gather(outs, tensor, blocking=not async_op)

    def gather(self, tensor: torch.Tensor, outs: list[torch.Tensor] | None, dst: int, *, async_op: bool = True) -> Work:
        _check_tensor(tensor, "gather")
        dst = self.group_rank(dst, "dst")
        if self.rank == dst:
            self._check_list(outs, "gather", "gather_list", like=tensor)
        return self._start_gather(tensor, outs if self.rank == dst else None, dst, blocking=not async_op)

    def scatter(self, tensor: torch.Tensor, ins: list[torch.Tensor] | None, src: int, *, async_op: bool = True) -> Work:
        _check_tensor(tensor, "scatter")
        src = self.group_rank(src, "src")
        if self.rank == src:
            self._check_list(ins, "scatter", "scatter_list", like=tensor)
        return self._start_scatter(tensor, ins if self.rank == src else None, src, blocking=not async_op)

    def reduce_scatter(self, out: torch.Tensor, ins: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM, *,
                       async_op: bool = True) -> Work:
        _check_tensor(out, "reduce_scatter")
        self._check_list(ins, "reduce_scatter", "input_list", like=out)
        return self._start_reduce_scatter(out, ins, _check_op(op, out.dtype, "reduce_scatter"), blocking=not async_op)

    def all_to_all(self, outs: list[torch.Tensor], ins: list[torch.Tensor], *, async_op: bool = True) -> Work:
        self._check_list(outs, "all_to_all", "output_tensor_list")
        self._check_list(ins, "all_to_all", "input_tensor_list")
        for what, tensors in (("output_tensor_list", outs), ("input_tensor_list", ins)):
            for i, t in enumerate(tensors):
                if t.dtype != ins[0].dtype:
                    raise TypeError(f"all_to_all: {what}[{i}] is {t.dtype} but input_tensor_list[0] is "
                                    f"{ins[0].dtype}; all tensors must share one dtype")
        return self._start_all_to_all(outs, ins, blocking=not async_op)

    def all_gather_coalesced(self, output_lists: list[list[torch.Tensor]], tensors: list[torch.Tensor]) -> Work:
        """all_gather of several tensors as one operation: `output_lists[r][i]` receives rank r's `tensors[i]`."""
        if len(output_lists) != self.size or any(len(outs) != len(tensors) for outs in output_lists):
            raise ValueError(f"all_gather_coalesced: output_tensor_lists must hold one list per rank ({self.size}), "
                             f"each with a tensor per input ({len(tensors)})")
        parts = [self.all_gather([outs[i] for outs in output_lists], tensor) for i, tensor in enumerate(tensors)]
        return AllOf("all_gather_coalesced", parts, self.timeout)

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor, *, async_op: bool = True) -> Work:
        """all_gather into one contiguous tensor: rank r's `tensor` lands in the r-th of its equal parts."""
        return self.all_gather(_rows(output, self.size, "all_gather_into_tensor"), tensor, async_op=async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                              async_op: bool = True) -> Work:
        """reduce_scatter of one tensor cut into equal parts: rank r's `output` gets the reduced r-th part."""
        return self.reduce_scatter(output, _rows(tensor.contiguous(), self.size, "reduce_scatter_tensor"), op,
                                   async_op=async_op)

    def all_to_all_single(self, output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: Sequence[int] | None,
                          input_split_sizes: Sequence[int] | None, *, async_op: bool = True) -> Work:
        """all_to_all of two tensors cut along their first dimension: into equal parts, or rows by the
        split sizes (one count per rank)."""
        if not output.is_contiguous():
            raise ValueError("all_to_all_single: the output tensor must be contiguous")
        outs = _split(output, output_split_sizes, self.size, "all_to_all_single")
        return self.all_to_all(outs, _split(tensor.contiguous(), input_split_sizes, self.size, "all_to_all_single"),
                                async_op=async_op)

    def barrier(self, *, async_op: bool = True, timeout: timedelta | None = None) -> Work:
        """Wait for every rank; `timeout` replaces the group's for this one barrier (longer or shorter)."""
        return self._start_barrier(blocking=not async_op, timeout=timeout)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, async_op: bool = True) -> Work:
        _check_tensor(tensor, "send")
        return self._start_send(tensor, self._peer(dst, "dst"), _check_tag(tag), blocking=not async_op)

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int = 0, *, async_op: bool = True) -> Work:
        """Receive into `tensor` from global rank `src`, or from whichever rank's message with `tag` comes
        first when `src` is None (the Work's `source_rank()` then names it)."""
        _check_tensor(tensor, "recv")
        peer = None if src is None else self._peer(src, "src")
        return self._start_recv(tensor, peer, _check_tag(tag), blocking=not async_op)

    def _peer(self, global_rank: int | None, role: str) -> int:
        if global_rank is None:
            raise ValueError(f"{role} must be given")
        peer = self.group_rank(global_rank, role)
        if peer == self.rank:
            raise ValueError(f"{role}={global_rank} is this rank itself; point-to-point needs another rank")
        return peer

    def _check_list(self, tensors: list[torch.Tensor] | None, fn: str, what: str,
                    like: torch.Tensor | None = None) -> None:
        if tensors is None or len(tensors) != self.size:
            got = "None" if tensors is None else f"{len(tensors)} tensors"
            raise ValueError(f"{fn}: {what} must hold one tensor per rank ({self.size}), got {got}")
        for i, t in enumerate(tensors):
            _check_tensor(t, f"{fn} {what}[{i}]")
            if like is not None and (t.numel() != like.numel() or t.dtype != like.dtype):
                raise ValueError(f"{fn}: {what}[{i}] is {t.dtype}{list(t.shape)} but the tensor is "
                                 f"{like.dtype}{list(like.shape)}; they must match in dtype and size")

    # ---- what a backend provides (`blocking`: the caller waits at once, so it may run inline) --

    @abc.abstractmethod
    def _start_all_reduce(self, tensor: torch.Tensor, op: ReduceOp, blocking: bool) -> Work: ...

    @abc.abstractmethod
    def _start_all_reduce_coalesced(self, tensors: list[torch.Tensor], op: ReduceOp, blocking: bool) -> Work: ...

    @abc.abstractmethod
    def _start_broadcast(self, tensor: torch.Tensor, src: int, blocking: bool) -> Work: ...

    @abc.abstractmethod
    def _start_reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, blocking: bool) -> Work: ...

    @abc.abstractmethod
    def _start_all_gather(self, outs: list[torch.Tensor], tensor: torch.Tensor, blocking: bool) -> Work: ...

    @abc.abstractmethod
    def _start_gather(self, tensor: torch.Tensor, outs: list[torch.Tensor] | None, dst: int,
                      blocking: bool) -> Work: ...

    @abc.abstractmethod
    def _start_scatter(self, tensor: torch.Tensor, ins: list[torch.Tensor] | None, src: int,
                       blocking: bool) -> Work: ...

    @abc.abstractmethod
    def _start_reduce_scatter(self, out: torch.Tensor, ins: list[torch.Tensor], op: ReduceOp,
                              blocking: bool) -> Work: ...

    @abc.abstractmethod
    def _start_all_to_all(self, outs: list[torch.Tensor], ins: list[torch.Tensor], blocking: bool) -> Work: ...

    @abc.abstractmethod
    def _start_barrier(self, blocking: bool, timeout: timedelta | None = None) -> Work: ...

    @abc.abstractmethod
    def _start_send(self, tensor: torch.Tensor, dst: int, tag: int, blocking: bool) -> Work: ...

    @abc.abstractmethod
    def _start_recv(self, tensor: torch.Tensor, src: int | None, tag: int, blocking: bool) -> Work:
        """`src` a group rank, or None: from any source."""

    @abc.abstractmethod
    def new_subgroup(self, ranks: Sequence[int], timeout: timedelta | None = None, *,
                     name: str | None = None) -> ProcessGroup | None:
        """A group of the given global ranks (in that order), with `timeout` (ours by default). Without a
        `name`, every rank of this group must call it, in the same order, and ranks outside `ranks` get
        None; with one, which its members agree on and no other live group of theirs bears, only the
        members call it."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Finish queued work and release connections."""


def _check_tensor(tensor: object, fn: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{fn}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError(f"{fn}: sparse tensors are not supported; call .to_dense() first")


def _rows(tensor: torch.Tensor, parts: int, fn: str) -> list[torch.Tensor]:
    """`tensor`, flat, cut into `parts` equal views."""
    _check_tensor(tensor, fn)
    if not tensor.is_contiguous():
        raise ValueError(f"{fn}: the tensor must be contiguous")
    if tensor.numel() % parts:
        raise ValueError(f"{fn}: a tensor of {tensor.numel()} elements does not split into {parts} equal parts")
    return list(tensor.view(parts, tensor.numel() // parts).unbind(0))


def _split(tensor: torch.Tensor, sizes: Sequence[int] | None, parts: int, fn: str) -> list[torch.Tensor]:
    """Contiguous `tensor` cut along its first dimension into `sizes` rows each (equal parts where none
    are given), as torch's all_to_all_single cuts it."""
    _check_tensor(tensor, fn)
    rows = tensor.shape[0] if tensor.dim() else 1
    if not sizes:
        if rows % parts:
            raise ValueError(f"{fn}: a first dimension of {rows} does not split into {parts} equal parts")
        sizes = [rows // parts] * parts
    if len(sizes) != parts or sum(sizes) != rows:
        raise ValueError(f"{fn}: split sizes {list(sizes)} must give one count per rank ({parts}) and add up "
                         f"to the tensor's first dimension ({rows})")
    per_row = tensor.numel() // rows if rows else 0
    return list(tensor.reshape(rows, per_row).split(list(sizes)))


_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def _check_op(op: object, dtype: torch.dtype, fn: str) -> ReduceOp:
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"unknown reduce op {op!r}; use one of {[o.name for o in ReduceOp]}") from None
    if op in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{fn}: {op.name} takes integer or bool tensors, got {dtype}")
    return op


def _check_tag(tag: int) -> int:
    if not isinstance(tag, int) or tag < 0:
        raise ValueError(f"tag must be a non-negative int, got {tag!r}")
    return tag
