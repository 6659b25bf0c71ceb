"""Distributed autograd as torch.distributed.autograd names it (`from shoal import autograd as
dist_autograd`): a context that RPCs record into, a backward that crosses workers, and the
gradients each worker accumulated.

```python
with dist_autograd.context() as context_id:
    loss = rpc.rpc_sync("ps", forward, args=(rref, x)).sum()    # recorded: x's gradient path
    dist_autograd.backward(context_id, [loss])                   # runs on every worker involved
    optimizer.step(context_id)                                   # shoal.optim.DistributedOptimizer
```
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from types import TracebackType

import torch

from shoal.autograd import engine
from shoal.forks import renew_locks_in_child
from shoal.parallel.ddp import DistributedDataParallel, register_sync_forward_hook
from shoal.rpc.autograd_context import Context
from shoal.rpc.autograd_contexts import contexts
from shoal.rpc.current import current_agent
from shoal.rpc.functions import runs_on_reader

# The DDP replicas whose forward ran in each context, in the order it ran them: weakly, by context and
# replica, so that neither outlives its use (a context ends with its `with`, or with a worker's death).
_forwarded: weakref.WeakKeyDictionary[Context, list[weakref.ref[DistributedDataParallel]]] = weakref.WeakKeyDictionary()
_forwarded_lock = threading.Lock()
renew_locks_in_child(globals(), "_forwarded_lock")


def _note_forward(replica: DistributedDataParallel) -> None:
    """A DDP forward inside a context: its gradients will be in the context, so the backward reduces them."""
    context_id = contexts.current_context()
    if context_id is None:
        return
    context = contexts.get(context_id)
    with _forwarded_lock:
        replicas = _forwarded.setdefault(context, [])
        if not any(ref() is replica for ref in replicas):
            replicas.append(weakref.ref(replica))


register_sync_forward_hook(_note_forward)


class context:  # torch.distributed.autograd's name, used as `with dist_autograd.context()`
    """A distributed autograd context for the calling thread; `with` gives its id. Every RPC the
    thread makes meanwhile records the tensors that require grad in it, on both ends; leaving the
    block releases it here at once and on every worker it reached soon after."""

    def __enter__(self) -> int:
        agent = current_agent()
        outer = contexts.current_context()
        if outer is not None:
            raise RuntimeError(f"this thread is already in distributed autograd context {outer}; contexts do "
                               f"not nest (leave the outer `with dist_autograd.context()` first)")
        self._context = contexts.create(agent.rank)
        self._serving = contexts.serving(self._context.id)
        self._serving.__enter__()
        return self._context.id

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._serving.__exit__(exc_type, exc, tb)
        release(self._context.id)


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Backward from the scalar `roots` through every worker the graph spans; returns when all of
    them are done. Gradients accumulate in the context on each worker (see get_gradients), not in
    `.grad`. A failure anywhere is raised here: the remote exception with its traceback attached,
    or PeerFailure naming a worker that died."""
    context = contexts.get(context_id)
    roots = list(roots)
    for index, root in enumerate(roots):
        if not isinstance(root, torch.Tensor) or not root.requires_grad:
            raise ValueError(f"backward: root {index} does not require grad, so no gradient can flow from it")
        if root.numel() != 1:
            raise ValueError(f"backward: root {index} has shape {tuple(root.shape)}; roots must be scalars "
                             f"(reduce them first, e.g. loss.sum())")
    # A graph that also leads to tensors sent elsewhere is kept: their gradients come back later
    # and continue through it. It is freed with the context.
    keep = retain_graph or context.has_sends()
    engine.backward(context, roots, keep, current_agent().default_timeout)
    # Replicas of DistributedDataParallel whose forward ran for this backward average their
    # gradients here, in the context, as their hooks would in `.grad` after a local backward; every
    # rank reduces them in the order its forwards ran, which the ranks share.
    with _forwarded_lock:
        forwarded = _forwarded.pop(context, [])
    for replica in filter(None, (ref() for ref in forwarded)):
        if replica.awaits_reduction():
            context.set_gradients(replica.reduce_gradients(context.gradients()))


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """{tensor: gradient} accumulated on this worker in the context."""
    return contexts.get(context_id).gradients()


@runs_on_reader
def release(context_id: int, covered: frozenset[int] = frozenset()) -> None:
    """End a context here, and tell every worker it reached to do the same, except those in
    `covered` (which others tell). As in PyTorch, nobody waits for the others: they release it as
    the notices arrive, each telling the workers it reached in turn. The notices are sent soon, not
    now: most ride on the next step's first call to each worker, at no cost of their own."""
    context = contexts.pop(context_id)
    if context is None:
        return
    agent = current_agent()
    targets = context.workers() - covered - {agent.rank}
    covered = covered | targets | {agent.rank}  # nobody sends it back to where it came from
    for worker in targets:
        agent.notify_soon(worker, release, (context_id, covered))
