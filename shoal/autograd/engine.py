"""The distributed backward pass. Each worker runs PyTorch's own engine over its local part of the
graph, from the roots on the worker that calls `backward` and from the tensors it sent elsewhere on
the others; a gradient that reaches a received tensor goes back, over RPC, to the worker that sent
it, which continues from there. A worker answers only once everything it passed gradients on to
has answered, so the originator's `backward` returns when the whole graph is done.

Only gradients that exist travel: a received tensor that does not lead to the roots gets none,
and nobody waits for it (PyTorch's engine would wait for every send in the context).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from shoal.autograd.context import Context
from shoal.autograd.registry import contexts
from shoal.rpc import api as rpc
from shoal.rpc.functions import async_execution
from shoal.rpc.future import Future

GradientBatch = list[tuple[int, int, torch.Tensor]]  # (send id, index in that send, gradient)


def run_pass(context: Context, outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
             retain_graph: bool) -> Future[None]:
    """Backward from `outputs` through this worker's graph: gradients of leaves made here
    accumulate in the context, those of received tensors go to their senders. The future
    completes when every sender has finished its part."""
    leaves = _leaves_reached(outputs)
    found = (torch.autograd.grad(outputs, leaves, grads, retain_graph=retain_graph, allow_unused=True)
             if leaves else ())
    onward: dict[int, GradientBatch] = {}
    for leaf, grad in zip(leaves, found, strict=True):
        if grad is None:
            continue
        origin = context.origin(leaf)
        if origin is None:
            context.accumulate(leaf, grad)
        else:
            src, send_id, index = origin
            onward.setdefault(src, []).append((send_id, index, grad))
    with contexts.serving(None):  # gradients are not part of the graph they flow through
        return all_done([rpc.rpc_async(src, gradients_arrive, args=(context.id, batch))
                         for src, batch in onward.items()])


@async_execution
def gradients_arrive(context_id: int, batch: GradientBatch) -> Future[None]:
    """On the worker that sent these tensors: continue the backward from them."""
    context = contexts.get(context_id)
    outputs = [context.sent(send_id, index) for send_id, index, _ in batch]
    # The graph is kept: another gradient for a tensor it shares may come later in this backward.
    # It is freed with the context.
    return run_pass(context, outputs, [grad for _, _, grad in batch], retain_graph=True)


def all_done(futures: list[Future]) -> Future[None]:
    """Completes when every one of `futures` has; with the first error among them, if any."""
    done: Future[None] = Future()
    lock = threading.Lock()
    remaining = [len(futures)]
    errors: list[BaseException] = []

    def one_done(future: Future) -> None:
        error = future.exception()
        with lock:
            if error is not None:
                errors.append(error)
            remaining[0] -= 1
            finished = remaining[0] == 0
        if finished:
            done._complete(None, errors[0] if errors else None)

    if not futures:
        done.set_result(None)
    for future in futures:
        future.add_done_callback(one_done)
    return done


def _leaves_reached(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor that requires grad and has no history (parameters, received tensors) on a path
    from `outputs` through the local graph: what the pass computes gradients for."""
    leaves: dict[int, torch.Tensor] = {}
    stack = []
    for tensor in outputs:
        if tensor.grad_fn is None:
            leaves[id(tensor)] = tensor
        else:
            stack.append(tensor.grad_fn)
    seen = set(stack)
    while stack:
        for node, _ in stack.pop().next_functions:
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
            if variable is not None:
                leaves[id(variable)] = variable
            else:
                stack.append(node)
    return list(leaves.values())
