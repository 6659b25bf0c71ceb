"""A shoal group as a torch.distributed ProcessGroup: torch's functions, and the C++ callers behind its
DDP and functional collectives, dispatch each operation here, by the method names torch gives them.

torch hands a group its own ranks (`opts.rootRank`, `dst`, `src`); shoal's group takes global ranks, so
each is translated through the group's member list. Under a device map that gives CUDA to NCCL, every
operation on CUDA tensors goes to torch's NCCL group instead (device_map.py)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as tdist
from torch.distributed import ReduceOp as TorchReduceOp

from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.as_torch import device_map
from shoal.comm.as_torch.work import TorchWork
from shoal.comm.backends.native import ShoalProcessGroup
from shoal.comm.backends.work import AllOf, Work

_REDUCE_OPS = {TorchReduceOp.SUM: ReduceOp.SUM, TorchReduceOp.AVG: ReduceOp.AVG,
               TorchReduceOp.PRODUCT: ReduceOp.PRODUCT, TorchReduceOp.MIN: ReduceOp.MIN,
               TorchReduceOp.MAX: ReduceOp.MAX, TorchReduceOp.BAND: ReduceOp.BAND,
               TorchReduceOp.BOR: ReduceOp.BOR, TorchReduceOp.BXOR: ReduceOp.BXOR}


def _one(tensors: list[torch.Tensor], fn: str) -> torch.Tensor:
    """torch passes one tensor per device of this rank; shoal's ranks each hold one."""
    if len(tensors) != 1:
        raise ValueError(f"{fn}: the shoal backend takes one tensor per rank, got {len(tensors)}")
    return tensors[0]


def _device_types(args: tuple | list) -> set[str]:
    """The devices of an operation's tensors (its lists nest)."""
    found = set()
    for arg in args:
        if isinstance(arg, torch.Tensor):
            found.add(arg.device.type)
        elif isinstance(arg, list | tuple):
            found |= _device_types(arg)
    return found


# torch 2.13 renamed these methods; its dispatch still finds the old names, and torch before it knows only
# those, so the group answers to both, and hands on by the old name, which torch's groups bind in each.
_OLD_NAMES = {"all_gather_single": "_allgather_base", "reduce_scatter_single": "_reduce_scatter_base",
              "all_to_all_single": "alltoall_base", "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
              "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced"}


def _by_device(method: Callable) -> Callable:
    """The operation on torch's group of the same method where the map gives its tensors' device to one."""
    name = _OLD_NAMES.get(method.__name__, method.__name__)

    @functools.wraps(method)
    def routed(self: TorchGroup, *args, **kwargs):
        other = self._other_backend((*args, *kwargs.values()))
        return method(self, *args, **kwargs) if other is None else getattr(other, name)(*args, **kwargs)
    return routed


class TorchGroup(tdist.ProcessGroup):
    """torch's face of `group` (ours, shoal's): what torch's `init_process_group("shoal")` and `new_group`
    return. `shoal_group` is what shoal's own functions use when given this group."""

    def __init__(self, group: ShoalProcessGroup, release: Callable[[], None], store: tdist.Store,
                 timeout: timedelta) -> None:
        super().__init__(group.rank, group.size)
        self.shoal_group = group
        self._release = release  # what destroying this group does to the shoal group (see world.py)
        self._name = ""
        self._desc = ""
        self._store, self._timeout = store, timeout  # for the groups of other backends a device map names
        self._map: dict[str, str] | None = None  # the devices others take, read from torch's record at first use
        self._others: dict[str, tdist.ProcessGroup] = {}
        self._building = threading.Lock()

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
        self._end(lambda other: other.shutdown())

    def abort(self) -> None:
        self._end(lambda other: other.abort())  # NCCL's abort, not its shutdown: a stuck collective may be why

    def _end(self, end_other: Callable[[tdist.ProcessGroup], None]) -> None:
        release, self._release = self._release, lambda: None
        with self._building:
            others, self._others, self._map = self._others, {}, {}  # ended: every operation on shoal's, refused
        try:
            release()
        finally:
            for other in others.values():
                end_other(other)

    # ---- helpers -----------------------------------------------------------------------------

    def _other_backend(self, args: tuple) -> tdist.ProcessGroup | None:
        """torch's group for this operation's device where the map names one, None where shoal runs it."""
        if self._map is None:
            self._map = {device: backend for device, backend in device_map.parse(tdist.get_backend_config(self)).items()
                         if backend != device_map.SHOAL}
        if not self._map:
            return None
        devices = _device_types(args) or {"cpu"}
        if len(devices) > 1:
            raise ValueError(f"an operation on tensors of {sorted(devices)} under the device map "
                             f"{tdist.get_backend_config(self)!r}: each device's backend takes its own tensors alone")
        device = devices.pop()
        with self._building:
            if device not in self._map:  # shoal's, or the group has ended
                return None
            if device not in self._others:
                self._others[device] = device_map.nccl_group(self._store, self.rank(), self.size(), self._timeout,
                                                             list(self.shoal_group.ranks), self._name)
            return self._others[device]

    def _global(self, group_rank: int) -> int:
        return self.shoal_group.ranks[group_rank]

    @staticmethod
    def _reduce_op(opts_op: TorchReduceOp, fn: str) -> tuple[ReduceOp, float | torch.Tensor | None]:
        """shoal's operator for torch's, and the factor PREMUL_SUM scales the sum by (None for the others)."""
        if opts_op.op == TorchReduceOp.PREMUL_SUM:
            if not hasattr(opts_op, "factor"):  # torch shows a group the factor from 2.13 on
                raise ValueError(f"{fn}: PREMUL_SUM on the shoal backend needs torch 2.13 or later, "
                                 f"which shows the group its factor")
            return ReduceOp.SUM, opts_op.factor
        try:
            return _REDUCE_OPS[opts_op.op], None
        except KeyError:
            raise ValueError(f"{fn}: reduce op {opts_op.op} is not supported by the shoal backend") from None

    @staticmethod
    def _scaled(outputs: list[torch.Tensor], factor: float | torch.Tensor | None) -> Callable[[], None] | None:
        """PREMUL_SUM's last step: the sum times the factor, in the outputs (a TorchWork's `then`)."""
        if factor is None:
            return None
        return lambda: [out.mul_(factor) for out in outputs]

    def _reducing(self, outputs: list[torch.Tensor], opts, fn: str, start: Callable[[ReduceOp], Work]) -> TorchWork:
        op, factor = self._reduce_op(opts.reduceOp, fn)
        return TorchWork(start(op), outputs, then=self._scaled(outputs, factor))

    # ---- collectives (`asyncOp` false: the caller waits at once, so shoal may run the op on its thread) ----

    @_by_device
    def allreduce(self, tensors, opts=None):
        opts, tensor = opts or tdist.AllreduceOptions(), _one(tensors, "allreduce")
        return self._reducing([tensor], opts, "allreduce",
                              lambda op: self.shoal_group.all_reduce(tensor, op, async_op=opts.asyncOp))

    @_by_device
    def allreduce_coalesced(self, tensors, opts=None):
        opts, tensors = opts or tdist.AllreduceCoalescedOptions(), list(tensors)
        return self._reducing(tensors, opts, "allreduce_coalesced",
                              lambda op: self.shoal_group.all_reduce_coalesced(tensors, op, async_op=opts.asyncOp))

    @_by_device
    def broadcast(self, tensors, opts=None):
        opts, tensor = opts or tdist.BroadcastOptions(), _one(tensors, "broadcast")
        return TorchWork(self.shoal_group.broadcast(tensor, self._global(opts.rootRank), async_op=opts.asyncOp),
                         [tensor])

    @_by_device
    def reduce(self, tensors, opts=None):
        opts, tensor = opts or tdist.ReduceOptions(), _one(tensors, "reduce")
        root = self._global(opts.rootRank)
        reduced = [tensor] if self.shoal_group.rank == opts.rootRank else []  # the other ranks' are left as given
        return self._reducing(reduced, opts, "reduce",
                              lambda op: self.shoal_group.reduce(tensor, root, op, async_op=opts.asyncOp))

    @_by_device
    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts or tdist.AllgatherOptions()
        outs, tensor = list(_one(output_tensors, "allgather")), _one(input_tensors, "allgather")
        return TorchWork(self.shoal_group.all_gather(outs, tensor, async_op=opts.asyncOp), outs)

    @_by_device
    def all_gather_single(self, output, input, opts=None):
        opts = opts or tdist.AllgatherOptions()
        return TorchWork(self.shoal_group.all_gather_into_tensor(output, input, async_op=opts.asyncOp), [output])

    @_by_device
    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        output_lists = [list(outs) for outs in output_lists]
        return TorchWork(self.shoal_group.all_gather_coalesced(output_lists, list(input_tensors)),
                         [t for outs in output_lists for t in outs])

    @_by_device
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        group = self.shoal_group
        parts = [group.all_gather_into_tensor(out, tensor) for out, tensor in zip(outputs, inputs, strict=True)]
        return self._coalesced("all_gather_into_tensor_coalesced", parts, list(outputs))

    @_by_device
    def gather(self, output_tensors, input_tensors, opts=None):
        opts, tensor = opts or tdist.GatherOptions(), _one(input_tensors, "gather")
        outs = list(_one(output_tensors, "gather")) if self.shoal_group.rank == opts.rootRank else None
        return TorchWork(self.shoal_group.gather(tensor, outs, self._global(opts.rootRank), async_op=opts.asyncOp),
                         outs or [])

    @_by_device
    def scatter(self, output_tensors, input_tensors, opts=None):
        opts, tensor = opts or tdist.ScatterOptions(), _one(output_tensors, "scatter")
        ins = list(_one(input_tensors, "scatter")) if self.shoal_group.rank == opts.rootRank else None
        return TorchWork(self.shoal_group.scatter(tensor, ins, self._global(opts.rootRank), async_op=opts.asyncOp),
                         [tensor])

    @_by_device
    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        opts = opts or tdist.ReduceScatterOptions()
        out, ins = _one(output_tensors, "reduce_scatter"), list(_one(input_lists, "reduce_scatter"))
        return self._reducing([out], opts, "reduce_scatter",
                              lambda op: self.shoal_group.reduce_scatter(out, ins, op, async_op=opts.asyncOp))

    @_by_device
    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or tdist.ReduceScatterOptions()
        group = self.shoal_group
        return self._reducing([output], opts, "reduce_scatter_tensor",
                              lambda op: group.reduce_scatter_tensor(output, input, op, async_op=opts.asyncOp))

    @_by_device
    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or tdist.ReduceScatterOptions()
        op, factor = self._reduce_op(opts.reduceOp, "reduce_scatter_tensor_coalesced")
        group = self.shoal_group
        parts = [group.reduce_scatter_tensor(out, tensor, op) for out, tensor in zip(outputs, inputs, strict=True)]
        work = AllOf("reduce_scatter_tensor_coalesced", parts, self.shoal_group.timeout)
        return TorchWork(work, list(outputs), then=self._scaled(list(outputs), factor))

    @_by_device
    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts, outs = opts or tdist.AllToAllOptions(), list(output_tensors)
        return TorchWork(self.shoal_group.all_to_all(outs, list(input_tensors), async_op=opts.asyncOp), outs)

    @_by_device
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or tdist.AllToAllOptions()
        work = self.shoal_group.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                  async_op=opts.asyncOp)
        return TorchWork(work, [output])

    @_by_device
    def barrier(self, opts=None):
        opts = opts or tdist.BarrierOptions()
        return TorchWork(self.shoal_group.barrier(async_op=opts.asyncOp), [])

    def _coalesced(self, name: str, parts: list[Work], result: list[torch.Tensor]) -> TorchWork:
        return TorchWork(AllOf(name, parts, self.shoal_group.timeout), result)

    # ---- point to point ----------------------------------------------------------------------

    @_by_device
    def send(self, tensors, dst, tag):
        tensor = _one(tensors, "send")
        return TorchWork(self.shoal_group.send(tensor, self._global(dst), tag), [tensor])

    @_by_device
    def recv(self, tensors, src, tag):
        tensor = _one(tensors, "recv")
        return TorchWork(self.shoal_group.recv(tensor, self._global(src), tag), [tensor])

    @_by_device
    def recv_anysource(self, tensors, tag):
        tensor = _one(tensors, "recv")
        work = self.shoal_group.recv(tensor, None, tag)
        return TorchWork(work, [tensor], source=lambda: self.shoal_group.group_rank(work.source_rank(), "src"))

    # the names torch before 2.13 dispatches by (see _OLD_NAMES)
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
    alltoall_base = all_to_all_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
