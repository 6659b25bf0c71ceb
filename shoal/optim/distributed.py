"""`DistributedOptimizer`: one ordinary torch.optim optimizer on each worker that owns some of the
parameters, stepped together with one distributed autograd context's gradients."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import torch

from shoal.autograd import get_gradients
from shoal.forks import renew_locks_in_child
from shoal.rpc import api as rpc
from shoal.rpc.rref import RRef

# Several trainers may step at once, each with its own DistributedOptimizer (and so its own local
# optimizer) over the same parameters: one lock for all of them on this worker keeps their steps from
# mixing each other's gradients.
_stepping = threading.Lock()
renew_locks_in_child(globals(), "_stepping")


class _LocalOptimizer:
    """Lives on a parameters' owner. Each step puts one context's gradients into `.grad` for its
    length only."""

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], params: list[torch.Tensor], args: tuple,
                 kwargs: dict) -> None:
        self._params = params
        self._optimizer = optimizer_class(self._params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        self.apply(get_gradients(context_id))

    def apply(self, gradients: dict[torch.Tensor, torch.Tensor]) -> None:
        """One optimizer step with these gradients; parameters without one are skipped."""
        with _stepping:
            for param in self._params:
                param.grad = gradients.get(param)
            try:
                self._optimizer.step()
            finally:
                for param in self._params:
                    param.grad = None


def _create(optimizer_class: type, params: list[RRef], args: tuple, kwargs: dict) -> _LocalOptimizer:
    """Runs on the owner of `params`."""
    return _LocalOptimizer(optimizer_class, [rref.local_value() for rref in params], args, kwargs)


def _step(local: RRef, context_id: int) -> None:
    local.local_value().step(context_id)


class DistributedOptimizer:
    """`DistributedOptimizer(torch.optim.SGD, [rref, ...], lr=0.05)`: any torch.optim optimizer
    over parameters given as RRefs (for instance from `RemoteModule.remote_parameters()`, or
    `RRef(p)` for local ones). `step(context_id)` steps every owner's optimizer at once with the
    gradients of that context and raises the first error any of them met."""

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], params_rref: list[RRef], *args: Any,
                 **kwargs: Any) -> None:
        if not params_rref:
            raise ValueError("DistributedOptimizer needs at least one parameter RRef")
        by_owner: dict[str, list[RRef]] = defaultdict(list)
        for rref in params_rref:
            if not isinstance(rref, RRef):
                raise TypeError(f"DistributedOptimizer takes parameters as RRefs (rpc.RRef(p) for local ones), "
                                f"got {type(rref).__name__}")
            by_owner[rref.owner_name()].append(rref)
        # Created concurrently; to_here() waits for each and raises what its constructor raised.
        pending = [rpc.remote(owner, _create, args=(optimizer_class, rrefs, args, kwargs))
                   for owner, rrefs in by_owner.items()]
        for local in pending:
            local.confirmed().wait()
        self._local_optimizers = pending

    def step(self, context_id: int) -> None:
        # Every owner's step runs on its RPC threads, this worker's own too, as torch's do: never on the
        # caller's thread, whose parallel ops hang in a process forked after a parallel op (autograd/engine.py).
        futures = [rpc.rpc_async(local.owner(), _step, args=(local, context_id)) for local in self._local_optimizers]
        errors = []
        for future in futures:
            try:
                future.wait()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
