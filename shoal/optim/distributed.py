"""`DistributedOptimizer`: one ordinary torch.optim optimizer on each worker that owns some of the
parameters, stepped together with one distributed autograd context's gradients."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import torch

from shoal.autograd import get_gradients
from shoal.rpc import api as rpc
from shoal.rpc.rref import RRef


class _LocalOptimizer:
    """Lives on a parameters' owner. Steps are serialized: several trainers may step it at once,
    each with its own context's gradients, which are put into `.grad` only for the step."""

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], params: list[RRef], args: tuple,
                 kwargs: dict) -> None:
        self._params = [rref.local_value() for rref in params]
        self._optimizer = optimizer_class(self._params, *args, **kwargs)
        self._lock = threading.Lock()

    def step(self, context_id: int) -> None:
        gradients = get_gradients(context_id)
        with self._lock:
            for param in self._params:
                param.grad = gradients.get(param)
            try:
                self._optimizer.step()
            finally:
                for param in self._params:
                    param.grad = None


def _create(optimizer_class: type, params: list[RRef], args: tuple, kwargs: dict) -> _LocalOptimizer:
    return _LocalOptimizer(optimizer_class, params, args, kwargs)


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
        # The other owners' steps start first; this worker's own runs here meanwhile, not over RPC.
        remote = [rpc.rpc_async(local.owner(), _step, args=(local, context_id))
                  for local in self._local_optimizers if not local.is_owner()]
        errors = []
        for local in self._local_optimizers:
            if local.is_owner():
                try:
                    local.local_value().step(context_id)
                except Exception as exc:
                    errors.append(exc)
        for future in remote:
            try:
                future.wait()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
