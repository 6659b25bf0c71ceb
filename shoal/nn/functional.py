"""Collectives that autograd differentiates through (torch.distributed.nn's): each forward runs a shoal
collective, and its backward runs the collective that carries the gradients back, so a model split
across ranks by hand (tensor parallelism, a gathered loss) trains with `loss.backward()`.

The gradient of each is the adjoint of its forward: broadcast's is a sum reduced to the root, all_gather's
a sum reduce-scattered back, all_to_all's the reverse exchange. Roots are global ranks, as in
shoal.distributed."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd import Function

import shoal.distributed as dist
from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.backends.group import ProcessGroup


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """`src`'s tensor on every rank; the gradient sums back to `src` (zero on the others)."""
    return _Broadcast.apply(src, group, tensor)


def gather(tensor: torch.Tensor, dst: int = 0, group: ProcessGroup | None = None) -> tuple[torch.Tensor, ...]:
    """Every rank's tensor, on `dst` (zeros elsewhere), one per rank; the gradients scatter back."""
    return _Gather.apply(dst, group, tensor)


def scatter(tensors: Sequence[torch.Tensor], src: int = 0, group: ProcessGroup | None = None) -> torch.Tensor:
    """Rank r gets `src`'s `tensors[r]` (the others pass tensors of the same shape); the gradients gather
    back on `src`."""
    return _Scatter.apply(src, group, *tensors)


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM,
           group: ProcessGroup | None = None) -> torch.Tensor:
    """The reduction on `dst` (the others get their own tensor back); the gradient is broadcast from `dst`
    (differentiable for SUM and AVG)."""
    return _Reduce.apply(dst, op, group, tensor)


def reduce_scatter(output: torch.Tensor, input_list: Sequence[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                   group: ProcessGroup | None = None) -> torch.Tensor:
    """Rank r's `output` becomes the reduction of every rank's `input_list[r]`; the gradients all-gather
    (differentiable for SUM and AVG)."""
    return _ReduceScatter.apply(op, group, output, *input_list)


def all_gather(tensor: torch.Tensor, group: ProcessGroup | None = None) -> tuple[torch.Tensor, ...]:
    """Every rank's tensor, one per rank, on every rank; the gradients sum back to their owners."""
    return _AllGather.apply(group, tensor)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: Sequence[torch.Tensor],
               group: ProcessGroup | None = None) -> tuple[torch.Tensor, ...]:
    """Rank r's `input_tensor_list[s]` lands in rank s's `output_tensor_list[r]`; gradients go back."""
    return _AllToAll.apply(group, output_tensor_list, *input_tensor_list)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Sequence[int] | None = None, input_split_sizes: Sequence[int] | None = None,
                      group: ProcessGroup | None = None) -> torch.Tensor:
    """all_to_all of two tensors cut along their first dimension; the gradient takes the way back."""
    return _AllToAllSingle.apply(group, output, output_split_sizes, input_split_sizes, input)


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None) -> torch.Tensor:
    """The reduction over every rank, on every rank (a new tensor); differentiable for SUM and AVG, whose
    gradient is the same reduction of the gradients."""
    return _AllReduce.apply(op, group, tensor)


def _adjoint_scale(op: ReduceOp, group: ProcessGroup | None, fn: str) -> float:
    """What the gradient of a reduction by `op` is scaled by: 1 for SUM, 1/n for AVG; other reductions are
    not linear in each input, and have no gradient here."""
    if op == ReduceOp.SUM:
        return 1.0
    if op == ReduceOp.AVG:
        return 1.0 / dist.get_world_size(group)
    raise RuntimeError(f"{fn} with {op.name} has no gradient here: only SUM and AVG are differentiable (each "
                       f"rank's input moves the result at every rank alike)")


def _rank(group: ProcessGroup | None) -> int:
    """This process's global rank (the roots above are global ranks)."""
    group = dist.default_group() if group is None else group
    return dist.get_process_group_ranks(group)[dist.get_rank(group)]


class _Broadcast(Function):
    @staticmethod
    def forward(ctx, src, group, tensor):
        ctx.src, ctx.group = src, group
        tensor = tensor.clone()
        dist.broadcast(tensor, src, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        grad = _Reduce.apply(ctx.src, ReduceOp.SUM, ctx.group, grad_output)
        if _rank(ctx.group) != ctx.src:
            grad = torch.zeros_like(grad)
        return None, None, grad


class _Reduce(Function):
    @staticmethod
    def forward(ctx, dst, op, group, tensor):
        ctx.dst, ctx.op, ctx.group = dst, ReduceOp(op), group
        tensor = tensor.clone()
        dist.reduce(tensor, dst, op=op, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        scale = _adjoint_scale(ctx.op, ctx.group, "reduce")
        return None, None, None, _Broadcast.apply(ctx.dst, ctx.group, grad_output) * scale


class _Gather(Function):
    @staticmethod
    def forward(ctx, dst, group, tensor):
        ctx.dst, ctx.group = dst, group
        parts = [torch.zeros_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.gather(tensor.contiguous(), parts if _rank(group) == dst else None, dst, group=group)
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grad_outputs):
        return None, None, _Scatter.apply(ctx.dst, ctx.group, *grad_outputs)


class _Scatter(Function):
    @staticmethod
    def forward(ctx, src, group, *tensors):
        ctx.src, ctx.group = src, group
        if any(t.shape != tensors[0].shape for t in tensors):
            raise ValueError(f"scatter: the tensors differ in shape ({[list(t.shape) for t in tensors]})")
        output = torch.zeros_like(tensors[0])
        dist.scatter(output, [t.contiguous() for t in tensors] if _rank(group) == src else None, src, group=group)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        return (None, None, *_Gather.apply(ctx.src, ctx.group, grad_output))


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx, op, group, output, *inputs):
        ctx.op, ctx.group = ReduceOp(op), group
        output = output.contiguous()
        dist.reduce_scatter(output, [t.contiguous() for t in inputs], op=op, group=group)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        scale = _adjoint_scale(ctx.op, ctx.group, "reduce_scatter")
        return (None, None, None, *(grad * scale for grad in _AllGather.apply(ctx.group, grad_output)))


class _AllGather(Function):
    @staticmethod
    def forward(ctx, group, tensor):
        ctx.group = group
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor, group=group)
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grad_outputs):
        grad = torch.empty_like(grad_outputs[dist.get_rank(ctx.group)])
        dist.reduce_scatter(grad, [g.contiguous() for g in grad_outputs], op=ReduceOp.SUM, group=ctx.group)
        return None, grad


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, group, outputs, *inputs):
        ctx.group = group
        ctx.input_shapes = [t.shape for t in inputs]
        dist.all_to_all(outputs, [t.contiguous() for t in inputs], group=group)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = [torch.empty(shape, dtype=grad_outputs[0].dtype, device=grad_outputs[0].device)
                 for shape in ctx.input_shapes]
        return (None, None, *_AllToAll.apply(ctx.group, grads, *grad_outputs))


class _AllToAllSingle(Function):
    @staticmethod
    def forward(ctx, group, output, output_split_sizes, input_split_sizes, input):
        ctx.group, ctx.input_shape = group, input.shape
        ctx.splits = (output_split_sizes, input_split_sizes)
        dist.all_to_all_single(output, input.contiguous(), output_split_sizes, input_split_sizes, group=group)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        grad = torch.empty(ctx.input_shape, dtype=grad_output.dtype, device=grad_output.device)
        output_split_sizes, input_split_sizes = ctx.splits
        return (None, None, None, None,
                _AllToAllSingle.apply(ctx.group, grad, input_split_sizes, output_split_sizes, grad_output.contiguous()))


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, op, group, tensor):
        ctx.op, ctx.group = ReduceOp(op), group
        tensor = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(tensor, op=op, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        _adjoint_scale(ctx.op, ctx.group, "all_reduce")  # refuses what has no gradient
        return None, None, _AllReduce.apply(ctx.op, ctx.group, grad_output)
