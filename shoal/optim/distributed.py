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

    def state_by_name(self, names: dict[torch.Tensor, tuple[str, str]]) -> dict[str, dict[str, dict]]:
        """A copy of each parameter's optimizer state and its group's settings, under the parameter's
        name (module key, parameter name), which survives a move of the module to another worker."""
        with _stepping:
            saved = self._optimizer.state_dict()
            by_name: dict[str, dict[str, dict]] = defaultdict(dict)
            for group, saved_group in zip(self._optimizer.param_groups, saved["param_groups"], strict=True):
                settings = {key: value for key, value in saved_group.items() if key != "params"}
                for param, index in zip(group["params"], saved_group["params"], strict=True):
                    key, name = _name_of(param, names)
                    by_name[key][name] = {"state": _copied(saved["state"].get(index, {})), "group": settings}
            return dict(by_name)

    def load_state_by_name(self, by_name: dict[str, dict[str, dict]],
                           names: dict[torch.Tensor, tuple[str, str]]) -> None:
        """Put back what `state_by_name` took, into this optimizer's parameters, however they are
        now spread across workers. A parameter missing from `by_name`, or a group whose parameters
        were saved with different settings, is a ValueError naming it."""
        state, groups, index = {}, [], 0
        for group in self._optimizer.param_groups:
            entries = []
            for param in group["params"]:
                key, name = _name_of(param, names)
                if name not in by_name.get(key, {}):
                    raise ValueError(f"the checkpoint holds no optimizer state for parameter {name!r} of module "
                                     f"{key!r}")
                entries.append(by_name[key][name])
            if any(entry["group"] != entries[0]["group"] for entry in entries):
                raise ValueError(f"the parameters of one optimizer group were saved with different settings "
                                 f"({[entry['group'] for entry in entries]}): group them as they were saved")
            for entry in entries:
                if entry["state"]:
                    state[index] = _copied(entry["state"])  # torch may keep the tensors it is given
                index += 1
            groups.append({**entries[0]["group"], "params": list(range(index - len(entries), index))})
        with _stepping:
            self._optimizer.load_state_dict({"state": state, "param_groups": groups})


def _name_of(param: torch.Tensor, names: dict[torch.Tensor, tuple[str, str]]) -> tuple[str, str]:
    if param not in names:
        raise ValueError(f"a parameter of shape {tuple(param.shape)} in a DistributedOptimizer belongs to none of the "
                         f"modules given to the checkpoint: name the module that holds it")
    return names[param]


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    """Tensors cloned: the live optimizer goes on changing its own in place."""
    return {key: value.detach().clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}


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

    @property
    def local_optimizers(self) -> list[RRef]:
        """RRefs to the optimizer on each owner (a model-parallel checkpoint reads and restores them)."""
        return list(self._local_optimizers)

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
