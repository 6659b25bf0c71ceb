"""A shoal group as a torch.distributed ProcessGroup: torch's functions, and the C++ callers behind its
DDP and functional collectives, dispatch each operation here, by the method names torch gives them.

torch hands a group its own ranks (`opts.rootRank`, `dst`, `src`); shoal's group takes global ranks, so
each is translated through the group's member list."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as tdist
from torch.distributed import ReduceOp as TorchReduceOp

from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.as_torch.work import AllOf, TorchWork
from shoal.comm.backends.native import ShoalProcessGroup
from shoal.comm.backends.work import Work

_REDUCE_OPS = {TorchReduceOp.SUM: ReduceOp.SUM, TorchReduceOp.AVG: ReduceOp.AVG,
               TorchReduceOp.PRODUCT: ReduceOp.PRODUCT, TorchReduceOp.MIN: ReduceOp.MIN,
               TorchReduceOp.MAX: ReduceOp.MAX, TorchReduceOp.BAND: ReduceOp.BAND,
               TorchReduceOp.BOR: ReduceOp.BOR, TorchReduceOp.BXOR: ReduceOp.BXOR}


def _one(tensors: list[torch.Tensor], fn: str) -> torch.Tensor:
    """torch passes one tensor per device of this rank; shoal's ranks each hold one."""
    if len(tensors) != 1:
        raise ValueError(f"{fn}: the shoal backend takes one tensor per rank, got {len(tensors)}")
    return tensors[0]


def _rows(tensor: torch.Tensor, parts: int, fn: str) -> list[torch.Tensor]:
    """`tensor` cut along its first dimension into `parts` equal views, for the *_single collectives."""
    if not tensor.is_contiguous():
        raise ValueError(f"{fn}: the tensor must be contiguous")
    if tensor.numel() % parts:
        raise ValueError(f"{fn}: a tensor of {tensor.numel()} elements does not split into {parts} equal parts")
    return list(tensor.view(parts, tensor.numel() // parts).unbind(0))


def _split(tensor: torch.Tensor, sizes: list[int], parts: int, fn: str) -> list[torch.Tensor]:
    """`tensor` cut along its first dimension into `sizes` rows each (equal parts where none are given)."""
    if not sizes:
        return _rows(tensor, parts, fn)
    if len(sizes) != parts or sum(sizes) != tensor.shape[0]:
        raise ValueError(f"{fn}: split sizes {list(sizes)} must give one count per rank ({parts}) and add up "
                         f"to the tensor's first dimension ({tensor.shape[0]})")
    if not tensor.is_contiguous():
        raise ValueError(f"{fn}: the tensor must be contiguous")
    return list(tensor.split(list(sizes)))


class TorchGroup(tdist.ProcessGroup):
    """torch's face of `group` (ours, shoal's): what torch's `init_process_group("shoal")` and `new_group`
    return. `shoal_group` is what shoal's own functions use when given this group."""

    def __init__(self, group: ShoalProcessGroup, release: Callable[[], None]) -> None:
        super().__init__(group.rank, group.size)
        self.shoal_group = group
        self._release = release  # what destroying this group does to the shoal group (see world.py)
        self._name = ""
        self._desc = ""

    def __repr__(self) -> str:
        return f"TorchGroup(shoal ranks={list(self.shoal_group.ranks)}, rank={self.shoal_group.rank})"

    # ---- what torch asks of every group ------------------------------------------------------

    def getBackendName(self) -> str:
        return "shoal"

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def shutdown(self) -> None:
        release, self._release = self._release, lambda: None
        release()

    def abort(self) -> None:
        self.shutdown()

    # ---- helpers -----------------------------------------------------------------------------

    def _global(self, group_rank: int) -> int:
        return self.shoal_group.ranks[group_rank]

    def _reduce_op(self, opts_op: TorchReduceOp, inputs: list[torch.Tensor], fn: str,
                   in_place: bool) -> tuple[ReduceOp, list[torch.Tensor]]:
        """shoal's operator for torch's, and the inputs to reduce: PREMUL_SUM is a SUM of inputs scaled by
        its factor first (copies, unless the op works in place on them anyway)."""
        if opts_op.op == TorchReduceOp.PREMUL_SUM:
            factor = opts_op.factor
            if in_place:
                for t in inputs:
                    t.mul_(factor)
                return ReduceOp.SUM, inputs
            return ReduceOp.SUM, [t * factor for t in inputs]
        try:
            return _REDUCE_OPS[opts_op.op], inputs
        except KeyError:
            raise ValueError(f"{fn}: reduce op {opts_op.op} is not supported by the shoal backend") from None

    @staticmethod
    def _work(work: Work, result: list[torch.Tensor]) -> TorchWork:
        return TorchWork(work, result)

    # ---- collectives -------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        tensor = _one(tensors, "allreduce")
        op, _ = self._reduce_op((opts or tdist.AllreduceOptions()).reduceOp, [tensor], "allreduce", in_place=True)
        return self._work(self.shoal_group.all_reduce(tensor, op), [tensor])

    def allreduce_coalesced(self, tensors, opts=None):
        op, _ = self._reduce_op((opts or tdist.AllreduceCoalescedOptions()).reduceOp, tensors,
                                "allreduce_coalesced", in_place=True)
        return self._work(self.shoal_group.all_reduce_coalesced(list(tensors), op), list(tensors))

    def broadcast(self, tensors, opts=None):
        tensor = _one(tensors, "broadcast")
        root = (opts or tdist.BroadcastOptions()).rootRank
        return self._work(self.shoal_group.broadcast(tensor, self._global(root)), [tensor])

    def reduce(self, tensors, opts=None):
        opts = opts or tdist.ReduceOptions()
        tensor = _one(tensors, "reduce")
        op, _ = self._reduce_op(opts.reduceOp, [tensor], "reduce", in_place=True)
        return self._work(self.shoal_group.reduce(tensor, self._global(opts.rootRank), op), [tensor])

    def allgather(self, output_tensors, input_tensors, opts=None):
        outs, tensor = _one(output_tensors, "allgather"), _one(input_tensors, "allgather")
        return self._work(self.shoal_group.all_gather(list(outs), tensor), list(outs))

    def all_gather_single(self, output, input, opts=None):
        outs = _rows(output, self.shoal_group.size, "all_gather_into_tensor")
        return self._work(self.shoal_group.all_gather(outs, input), [output])

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        parts = [self.shoal_group.all_gather(list(outs), tensor)
                 for outs, tensor in zip(output_lists, input_tensors, strict=True)]
        return self._coalesced("allgather_coalesced", parts, [t for outs in output_lists for t in outs])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        size = self.shoal_group.size
        parts = [self.shoal_group.all_gather(_rows(out, size, "all_gather_into_tensor_coalesced"), tensor)
                 for out, tensor in zip(outputs, inputs, strict=True)]
        return self._coalesced("all_gather_into_tensor_coalesced", parts, list(outputs))

    def gather(self, output_tensors, input_tensors, opts=None):
        root = (opts or tdist.GatherOptions()).rootRank
        tensor = _one(input_tensors, "gather")
        outs = list(_one(output_tensors, "gather")) if self.shoal_group.rank == root else None
        return self._work(self.shoal_group.gather(tensor, outs, self._global(root)), outs or [])

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = (opts or tdist.ScatterOptions()).rootRank
        tensor = _one(output_tensors, "scatter")
        ins = list(_one(input_tensors, "scatter")) if self.shoal_group.rank == root else None
        return self._work(self.shoal_group.scatter(tensor, ins, self._global(root)), [tensor])

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        out, ins = _one(output_tensors, "reduce_scatter"), list(_one(input_lists, "reduce_scatter"))
        op, ins = self._reduce_op((opts or tdist.ReduceScatterOptions()).reduceOp, ins, "reduce_scatter",
                                  in_place=False)
        return self._work(self.shoal_group.reduce_scatter(out, ins, op), [out])

    def reduce_scatter_single(self, output, input, opts=None):
        work = self._reduce_scatter_one(output, input, opts or tdist.ReduceScatterOptions(), "reduce_scatter_tensor")
        return self._work(work, [output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or tdist.ReduceScatterOptions()
        parts = [self._reduce_scatter_one(out, tensor, opts, "reduce_scatter_tensor_coalesced")
                 for out, tensor in zip(outputs, inputs, strict=True)]
        return self._coalesced("reduce_scatter_tensor_coalesced", parts, list(outputs))

    def _reduce_scatter_one(self, output, tensor, opts, fn: str) -> Work:
        ins = _rows(tensor, self.shoal_group.size, fn)
        op, ins = self._reduce_op(opts.reduceOp, ins, fn, in_place=False)
        return self.shoal_group.reduce_scatter(output, ins, op)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        return self._work(self.shoal_group.all_to_all(list(output_tensors), list(input_tensors)),
                          list(output_tensors))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        size = self.shoal_group.size
        outs = _split(output, output_split_sizes, size, "all_to_all_single")
        ins = _split(input, input_split_sizes, size, "all_to_all_single")
        return self._work(self.shoal_group.all_to_all(outs, ins), [output])

    def barrier(self, opts=None):
        return self._work(self.shoal_group.barrier(), [])

    def _coalesced(self, name: str, parts: list[Work], result: list[torch.Tensor]) -> TorchWork:
        return self._work(AllOf(name, parts, self.shoal_group.timeout), result)

    # ---- point to point ----------------------------------------------------------------------

    def send(self, tensors, dst, tag):
        tensor = _one(tensors, "send")
        return self._work(self.shoal_group.send(tensor, self._global(dst), tag), [tensor])

    def recv(self, tensors, src, tag):
        tensor = _one(tensors, "recv")
        return self._work(self.shoal_group.recv(tensor, self._global(src), tag), [tensor])

    def recv_anysource(self, tensors, tag):
        raise ValueError("recv from any source is not supported by the shoal backend: give src")
