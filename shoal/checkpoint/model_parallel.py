"""Checkpoints of a model-parallel job: the state of modules that live on other workers (behind
RRefs or RemoteModules) and of a DistributedOptimizer's optimizers on their owners, saved in one
call and restored onto whichever workers hold the modules when it is loaded.

    checkpoints = ModelParallelCheckpoint("ckpt", keep=3, async_save=True)
    checkpoints.save(step, {"embedding": embedding, "head": head}, optimizer, extra={"rng": capture_rng()})
    latest = checkpoints.load_latest({"embedding": embedding, "head": head}, optimizer)   # None, or its step and extra

Each owner copies its modules' state and its optimizers' state at `save`; the caller gathers the
copies into one file, written as CheckpointManager writes (atomic, verified, the newest `keep`
kept, in the background with `async_save`). Optimizer state is stored by parameter name, not by
position, so a restarted job may place the modules differently, on fewer workers.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from shoal.checkpoint.manager import Checkpoint, CheckpointManager
from shoal.nn.remote_module import RemoteModule
from shoal.optim.distributed import DistributedOptimizer
from shoal.rpc import api as rpc
from shoal.rpc.rref import RRef

Modules = dict[str, "RRef | RemoteModule"]


def _parameter_names(modules: dict[str, Any]) -> dict[torch.Tensor, tuple[str, str]]:
    return {param: (key, name) for key, module in modules.items() if isinstance(module, nn.Module)
            for name, param in module.named_parameters()}


def _copy_state(modules: dict[str, RRef], optimizers: list[RRef]) -> tuple[dict, dict]:
    """Runs on the owner of `modules` and `optimizers`: copies of their state."""
    values = {key: rref.local_value() for key, rref in modules.items()}
    states = {key: {name: value.detach().clone() if isinstance(value, torch.Tensor) else value
                    for name, value in module.state_dict().items()} for key, module in values.items()}
    names = _parameter_names(values)
    optimizer_state: dict[str, dict] = defaultdict(dict)
    for local in optimizers:
        for key, by_name in local.local_value().state_by_name(names).items():
            optimizer_state[key].update(by_name)
    return states, dict(optimizer_state)


def _restore_state(modules: dict[str, RRef], states: dict[str, dict], optimizers: list[RRef],
                   optimizer_state: dict[str, dict] | None) -> None:
    """Runs on the owner of `modules` and `optimizers`: loads what `_copy_state` copied, in place."""
    values = {key: rref.local_value() for key, rref in modules.items()}
    for key, module in values.items():
        module.load_state_dict(states[key])
    if optimizer_state is not None:
        names = _parameter_names(values)
        for local in optimizers:
            local.local_value().load_state_by_name(optimizer_state, names)


def _module_rref(key: str, module: RRef | RemoteModule) -> RRef:
    if isinstance(module, RemoteModule):
        return module.get_module_rref()
    if isinstance(module, RRef):
        return module
    raise TypeError(f"module {key!r}: a model-parallel checkpoint takes RRefs to modules or RemoteModules, "
                    f"not {type(module).__name__}")


def _by_owner(modules: Modules, optimizer: DistributedOptimizer | None) -> dict[str, tuple[dict, list]]:
    """For each worker: the modules (key -> RRef) and the optimizers it owns."""
    placement: dict[str, tuple[dict, list]] = defaultdict(lambda: ({}, []))
    for key, module in modules.items():
        rref = _module_rref(key, module)
        placement[rref.owner_name()][0][key] = rref
    for local in optimizer.local_optimizers if optimizer is not None else []:
        placement[local.owner_name()][1].append(local)
    return dict(placement)


def _wait_all(futures: dict[str, Any]) -> dict[str, Any]:
    """Every owner's answer; the first error once all have answered (none is left running)."""
    results, errors = {}, []
    for owner, future in futures.items():
        try:
            results[owner] = future.wait()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    return results


class ModelParallelCheckpoint:
    """Saves and restores the modules of a model-parallel job, wherever they live, and its
    DistributedOptimizer's state. One worker calls `save` and `load_latest`, at a point between
    steps where no optimizer step runs (each owner copies its part when asked: parameters that a
    step changes meanwhile would mix two steps)."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3, async_save: bool = False) -> None:
        self._manager = CheckpointManager(directory, keep=keep, async_save=async_save, rank=0)

    def save(self, step: int, modules: Modules, optimizer: DistributedOptimizer | None = None, *,
             extra: dict[str, Any] | None = None) -> None:
        """Checkpoint `modules` (key -> RRef to a module, or RemoteModule), the optimizer's state on
        every owner, and `extra` (this worker's own state: the data's position, RNG) as of `step`.
        Every parameter the optimizer steps must belong to one of `modules`. With async_save,
        returns once every owner's copy has arrived."""
        futures = {owner: rpc.rpc_async(owner, _copy_state, args=(owned, optimizers))
                   for owner, (owned, optimizers) in _by_owner(modules, optimizer).items()}
        module_state, optimizer_state = {}, {}
        for states, by_name in _wait_all(futures).values():
            module_state.update(states)
            optimizer_state.update(by_name)
        self._manager.save(step, {"modules": module_state, "optimizer": optimizer_state if optimizer else None,
                                  "extra": extra or {}})

    def load_latest(self, modules: Modules, optimizer: DistributedOptimizer | None = None) -> Checkpoint | None:
        """Restore the newest checkpoint that verifies into `modules` (the same keys as saved, on any
        workers) and `optimizer`; returns its step and `extra` (as `state`), or None if there is none."""
        latest = self._manager.load_latest()
        if latest is None:
            return None
        saved = latest.state
        if set(modules) != set(saved["modules"]):
            raise ValueError(f"checkpoint {latest.path} holds modules {sorted(saved['modules'])}, but "
                             f"{sorted(modules)} were given to restore")
        if optimizer is not None and saved["optimizer"] is None:
            raise ValueError(f"checkpoint {latest.path} holds no optimizer state (it was saved without an optimizer)")
        optimizer_state = saved["optimizer"] if optimizer is not None else None
        futures = {}
        for owner, (owned, optimizers) in _by_owner(modules, optimizer).items():
            states = {key: saved["modules"][key] for key in owned}
            mine = None if optimizer_state is None else {key: optimizer_state.get(key, {}) for key in owned}
            futures[owner] = rpc.rpc_async(owner, _restore_state, args=(owned, states, optimizers, mine))
        _wait_all(futures)
        return Checkpoint(latest.step, saved["extra"], latest.path)

    def wait(self) -> None:
        """Block until a background write has finished; raise its error if it failed."""
        self._manager.wait()
