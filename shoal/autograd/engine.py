"""The distributed backward pass. Each worker runs PyTorch's own engine over its local part of the
graph, from the roots on the worker that calls `backward` and from the tensors it sent elsewhere on
the others; a gradient that reaches a received tensor goes, as an RPC notice, to the worker that
made that tensor, which continues from there.

Only gradients that exist travel: a received tensor that does not lead to the roots gets none,
and nobody waits for it (PyTorch's engine would wait for every send in the context).

Knowing when the whole graph is done: the originator holds a weight of 1. A pass that passes
gradients on splits the weight it got equally among the workers it sends them to, once its own
gradients are in the context; a pass that passes none on, or fails, returns its weight to the
originator (with the error). When the originator has all of it back, no pass is left anywhere. So
only the ends of the graph tell the originator, directly: along a chain, one message on the way
back however long it is, where answering the worker before in turn would take one per hop.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence
from fractions import Fraction

import torch

from shoal.errors import GroupBrokenError, PeerFailure
from shoal.rpc.autograd_context import Context
from shoal.rpc.autograd_contexts import contexts
from shoal.rpc.current import current_agent
from shoal.rpc.functions import runs_on_reader
from shoal.rpc.message import PackedError, pack_error, unpack_error

GradientBatch = list[tuple[int, int, torch.Tensor]]  # (send id, index in that send, gradient)
Completion = tuple[int, int]  # (originator's rank, its backward's number): where weight goes back


class _Backward:
    """A distributed backward this worker started in `context`: the weight back so far, and the first error."""

    def __init__(self, context: Context) -> None:
        self.context = context
        self.lock = threading.Lock()
        self.returned = Fraction(0)
        self.error: BaseException | None = None
        self.over = threading.Event()

    def add(self, weight: Fraction, error: BaseException | None) -> None:
        with self.lock:
            self.returned += weight
            if error is not None and self.error is None:
                self.error = error
            if self.returned == 1 or self.error is not None:  # an error ends it at once, as in PyTorch
                self.over.set()


_numbers = itertools.count()
_running: dict[int, _Backward] = {}
_running_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child runs none of its parent's backwards (and its parent's lock may be held for good)."""
    global _running, _running_lock
    _running, _running_lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def backward(context: Context, roots: Sequence[torch.Tensor], retain_graph: bool, timeout: float) -> None:
    """Run the distributed backward from `roots` and return once every pass of it is done; raise
    the first error any pass met, PeerFailure if a worker died meanwhile, TimeoutError after
    `timeout` seconds.

    Every pass runs on the passes thread, this worker's own too, as torch runs its distributed backward
    on an engine thread: in a process forked after its parent ran a parallel torch op, OpenMP's threads
    for the main thread are the parent's, which the child lacks, and a parallel op there waits for them
    for good; a thread started in the child gets threads of its own."""
    number, record = next(_numbers), _Backward(context)
    with _running_lock:
        _running[number] = record
    try:
        own = threading.Event()  # this worker's own pass is over: `timeout` bounds the others', as it always has

        def first_pass() -> None:
            try:
                run_pass(context, roots, [torch.ones_like(root) for root in roots], retain_graph,
                         (current_agent().rank, number), Fraction(1))
            finally:
                own.set()

        if contexts.passes.on_own_thread():  # a backward started from within a pass: the thread is ours
            first_pass()
        else:
            contexts.passes.submit(first_pass)
        own.wait()
        if not record.over.wait(timeout):
            raise TimeoutError(f"distributed backward in context {context.id} did not finish within {timeout:g}s")
        if record.error is not None:
            raise record.error
    finally:
        with _running_lock:
            _running.pop(number, None)


def _fail_running(rank: int) -> None:
    """A worker died: no backward started here that reaches other workers can be sure of finishing
    (its part may have been there, or passed on there), so each fails now, naming it, rather than at
    its deadline. One whose context has touched no other worker runs here alone, and goes on."""
    with _running_lock:
        records = [record for record in _running.values() if record.context.workers()]
    if records:
        error = PeerFailure(rank, f"worker {current_agent().worker(rank).name!r} died during a distributed backward")
        for record in records:
            record.add(Fraction(0), error)


contexts.when_peer_fails(_fail_running)


def run_pass(context: Context, outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
             retain_graph: bool, completion: Completion, weight: Fraction) -> None:
    """Backward from `outputs` through this worker's graph: gradients of leaves made here
    accumulate in the context, those of received tensors go to the workers that made them, each
    with an equal share of `weight`, which goes back to the originator if they go nowhere."""
    try:
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
    except BaseException as exc:
        _give_back(completion, weight, exc)
        return
    if not onward:
        _give_back(completion, weight, None)
        return
    share = weight / len(onward)
    agent = current_agent()
    for src, batch in onward.items():
        try:
            agent.notify(src, gradients_arrive, (context.id, batch, completion, share))
        except Exception as exc:  # the worker is gone, or the gradients could not be sent
            _give_back(completion, share, exc)


@runs_on_reader
def gradients_arrive(context_id: int, batch: GradientBatch, completion: Completion, weight: Fraction) -> None:
    """On the worker that made these tensors: continue the backward from them, on this worker's
    thread for passes."""
    try:
        contexts.passes.submit(_continue_pass, context_id, batch, completion, weight)
    except RuntimeError as exc:  # shut down with the agent, or no thread to be had
        _give_back(completion, weight, exc)


def _continue_pass(context_id: int, batch: GradientBatch, completion: Completion, weight: Fraction) -> None:
    try:
        context = contexts.get(context_id)
        outputs = [context.sent(send_id, index) for send_id, index, _ in batch]
    except BaseException as exc:
        _give_back(completion, weight, exc)
        return
    # The graph is kept: another gradient for a tensor it shares may come later in this backward.
    # It is freed with the context.
    run_pass(context, outputs, [grad for _, _, grad in batch], True, completion, weight)


def _give_back(completion: Completion, weight: Fraction, error: BaseException | None) -> None:
    originator, number = completion
    agent = current_agent()
    packed = pack_error(error, agent.name) if error is not None else None
    if originator == agent.rank:
        weight_returned(number, weight, packed)
        return
    try:
        agent.notify(originator, weight_returned, (number, weight, packed))
    except (PeerFailure, GroupBrokenError):
        pass  # the originator is gone, and its backward with it


@runs_on_reader
def weight_returned(number: int, weight: Fraction, error: PackedError | None) -> None:
    """On the originator: a pass of backward `number` is done, or failed."""
    with _running_lock:
        record = _running.get(number)
    if record is not None:  # else it ended already (an error, a timeout)
        record.add(weight, unpack_error(error) if error is not None else None)


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
