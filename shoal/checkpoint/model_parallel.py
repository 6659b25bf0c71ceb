"""Checkpoints of a model-parallel job: the state of modules that live on other workers (behind
RRefs or RemoteModules) and of a DistributedOptimizer's optimizers on their owners, saved in one
call and restored onto whichever workers hold the modules when it is loaded.

    checkpoints = ModelParallelCheckpoint("ckpt", keep=3, async_save=True)
    checkpoints.save(step, {"embedding": embedding, "head": head}, optimizer, extra={"rng": capture_rng()})
    latest = checkpoints.load_latest({"embedding": embedding, "head": head}, optimizer)   # None, or its step and extra

Each owner copies its modules' state and its optimizers' state at `save`; the caller gathers the
copies into one file, written as CheckpointManager writes (atomic, verified, the newest `keep`
kept, in the background with `async_save`). Optimizer state is stored by parameter name, not by
position, so a restarted job may place the modules differently, on fewer workers. Several
optimizers (one per trainer of a parameter server) are saved and restored as {key: optimizer}.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from shoal.checkpoint.manager import Checkpoint, CheckpointManager, snapshot
from shoal.nn.remote_module import RemoteModule
from shoal.optim.distributed import DistributedOptimizer
from shoal.rpc import api as rpc
from shoal.rpc.rref import RRef

Modules = dict[str, "RRef | RemoteModule"]
Optimizers = DistributedOptimizer | Mapping[str, DistributedOptimizer] | None
_ONE = ""  # the key of an optimizer given alone


def _parameter_names(modules: dict[str, Any]) -> dict[torch.Tensor, tuple[str, str]]:
    return {param: (key, name) for key, module in modules.items() if isinstance(module, nn.Module)
            for name, param in module.named_parameters()}


def _copy_state(modules: dict[str, RRef], optimizers: list[RRef], with_modules: bool) -> tuple[dict, dict]:
    """Runs on the owner of `modules` and `optimizers`: copies of the optimizers' state, and of the
    modules' too if `with_modules`."""
    values = {key: rref.local_value() for key, rref in modules.items()}
    states = {key: {name: value.detach().clone() if isinstance(value, torch.Tensor) else value
                    for name, value in module.state_dict().items()} for key, module in values.items()
              if with_modules}
    names = _parameter_names(values)
    optimizer_state: dict[str, dict] = defaultdict(dict)
    for local in optimizers:
        for key, by_name in local.local_value().state_by_name(names).items():
            optimizer_state[key].update(by_name)
    return states, dict(optimizer_state)


def _step_and_copy(modules: dict[str, RRef], optimizers: list[RRef], context_id: int) -> tuple[dict, dict]:
    """Runs on the owner of `modules` and `optimizers`: their step with the gradients of `context_id`,
    then `_copy_state` of what it left."""
    for local in optimizers:
        local.local_value().step(context_id)
    return _copy_state(modules, optimizers, True)


def _restore_state(modules: dict[str, RRef], states: dict[str, dict], optimizers: list[RRef],
                   optimizer_state: dict[str, dict] | None, named: dict[str, RRef]) -> None:
    """Runs on the owner of `modules`, `optimizers` and `named` (the modules whose parameters the
    optimizers step): loads what `_copy_state` copied, in place."""
    for key, rref in modules.items():
        rref.local_value().load_state_dict(states[key])
    if optimizer_state is not None:
        names = _parameter_names({key: rref.local_value() for key, rref in named.items()})
        for local in optimizers:
            local.local_value().load_state_by_name(optimizer_state, names)


def _module_rref(key: str, module: RRef | RemoteModule) -> RRef:
    if isinstance(module, RemoteModule):
        return module.get_module_rref()
    if isinstance(module, RRef):
        return module
    raise TypeError(f"module {key!r}: a model-parallel checkpoint takes RRefs to modules or RemoteModules, "
                    f"not {type(module).__name__}")


def _keyed(optimizer: Optimizers) -> dict[str, DistributedOptimizer]:
    if optimizer is None:
        return {}
    return {_ONE: optimizer} if isinstance(optimizer, DistributedOptimizer) else dict(optimizer)


def _by_owner(modules: Modules, optimizer: DistributedOptimizer | None) -> dict[str, tuple[dict, list]]:
    """For each worker: the modules (key -> RRef) and the optimizers it owns."""
    placement: dict[str, tuple[dict, list]] = defaultdict(lambda: ({}, []))
    for key, module in modules.items():
        rref = _module_rref(key, module)
        placement[rref.owner_name()][0][key] = rref
    for local in optimizer.local_optimizers if optimizer is not None else []:
        placement[local.owner_name()][1].append(local)
    return dict(placement)


def call_on(owner: str, fn: Any, args: tuple) -> torch.futures.Future:
    """`fn(*args)` on `owner`: here without an RPC when that is this worker, so that a checkpoint
    taken or loaded inside an RPC handler does not wait for a second thread of the pool."""
    if owner != rpc.get_worker_info().name:
        return rpc.rpc_async(owner, fn, args=args)
    done: torch.futures.Future = torch.futures.Future()
    try:
        done.set_result(fn(*args))
    except Exception as exc:
        done.set_exception(exc)
    return done


def _gather(modules: Modules, optimizer: DistributedOptimizer | None, *, with_modules: bool,
            context_id: int | None = None) -> tuple[dict, dict]:
    """Every owner's copy of `optimizer`'s state there (if any), by the names of its parameters in
    `modules`, and of its modules' state too if `with_modules`: one call to each owner. With a
    `context_id`, each owner first steps `optimizer` with that context's gradients, on its RPC
    threads as DistributedOptimizer.step does."""
    placement = _by_owner(modules, optimizer)
    futures = {owner: call_on(owner, _copy_state, (owned, optimizers, with_modules)) if context_id is None else
               rpc.rpc_async(owner, _step_and_copy, args=(owned, optimizers, context_id))
               for owner, (owned, optimizers) in placement.items()}
    module_state, optimizer_state = {}, {}
    for states, by_name in _wait_all(futures).values():
        module_state.update(states)
        optimizer_state.update(by_name)
    return module_state, optimizer_state


def _scatter(modules: Modules, module_state: dict | None, optimizer: DistributedOptimizer | None,
             optimizer_state: dict | None) -> None:
    """Send each owner its modules' state (unless None) and `optimizer`'s state there (unless None)."""
    futures = {}
    for owner, (owned, optimizers) in _by_owner(modules, optimizer).items():
        states = {key: module_state[key] for key in owned} if module_state is not None else {}
        mine = None if optimizer_state is None else {key: optimizer_state.get(key, {}) for key in owned}
        futures[owner] = call_on(owner, _restore_state,
                             (owned if module_state is not None else {}, states, optimizers, mine, owned))
    _wait_all(futures)


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


class _InMemory:
    """The store of `ModelParallelCheckpoint.in_memory()`: the newest save, in this process."""

    def __init__(self) -> None:
        self._newest: Checkpoint | None = None

    def save(self, step: int, state: dict[str, Any]) -> None:
        # The owners' copies are this state's own; `extra` is the caller's, which later steps change.
        self._newest = Checkpoint(step, {**state, "extra": snapshot(state["extra"])}, "memory")

    def load_latest(self) -> Checkpoint | None:
        return self._newest

    def wait(self) -> None:
        """Saves are synchronous: nothing is left to wait for."""


class ModelParallelCheckpoint:
    """Saves and restores the modules of a model-parallel job, wherever they live, and the state of
    its DistributedOptimizers. One worker calls `save` and `load_latest`, at a point between steps
    where no optimizer step runs (each owner copies its part when asked: parameters that a step
    changes meanwhile would mix two steps)."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3, async_save: bool = False) -> None:
        self._store = CheckpointManager(directory, keep=keep, async_save=async_save, rank=0)
        self._loaded: Checkpoint | None = None

    @staticmethod
    def in_memory() -> ModelParallelCheckpoint:
        """One that keeps its newest save in this process's memory, not on disk: a replica of the
        modules for a worker that holds none of them (a pipeline's driver), taken after every step."""
        memory = object.__new__(ModelParallelCheckpoint)  # no directory: no __init__
        memory._store, memory._loaded = _InMemory(), None
        return memory

    def save(self, step: int, modules: Modules, optimizer: Optimizers = None, *,
             extra: dict[str, Any] | None = None) -> None:
        """Checkpoint `modules` (key -> RRef to a module, or RemoteModule), the optimizer's state on
        every owner (or each optimizer's, given as {key: optimizer}), and `extra` (this worker's own
        state: the data's position, RNG) as of `step`. Every parameter an optimizer steps must belong
        to one of `modules`. With async_save, returns once every owner's copy has arrived."""
        keyed = list(_keyed(optimizer).items())
        first = keyed[0] if keyed else (None, None)
        module_state, by_name = _gather(modules, first[1], with_modules=True)  # with the first optimizer's
        optimizer_states = {first[0]: by_name} if keyed else {}
        for key, each in keyed[1:]:
            optimizer_states[key] = _gather(modules, each, with_modules=False)[1]
        self._store.save(step, {"modules": module_state, "optimizers": optimizer_states, "extra": extra or {}})

    def step_and_save(self, step: int, modules: Modules, optimizer: DistributedOptimizer, context_id: int, *,
                      extra: dict[str, Any] | None = None) -> None:
        """`optimizer.step(context_id)`, then `save(step, modules, optimizer, extra=extra)`, in one call
        to each owner (the state copied right after its step there): what a replica taken after every
        step costs is then mostly the copy. An owner whose step failed raises, once all have answered;
        the others' steps are applied and nothing is saved."""
        module_state, by_name = _gather(modules, optimizer, with_modules=True, context_id=context_id)
        self._store.save(step, {"modules": module_state, "optimizers": {_ONE: by_name}, "extra": extra or {}})

    def load_latest(self, modules: Modules, optimizer: Optimizers = None, *,
                    accept: Callable[[Checkpoint], None] | None = None) -> Checkpoint | None:
        """Restore the newest checkpoint that verifies into `modules` (the same keys as saved, on any
        workers) and `optimizer` (or {key: optimizer}, some of those saved); returns its step and
        `extra` (as `state`), or None if there is none. `accept` sees that before anything is
        restored, and refuses the checkpoint by raising. Optimizers made later are restored from the
        same checkpoint by `restore_optimizer`."""
        latest = self.latest()
        return None if latest is None else self.restore(latest, modules, optimizer, accept=accept)

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies, as saved, restored nowhere (to compare it with others)."""
        return self._store.load_latest()

    def restore(self, latest: Checkpoint, modules: Modules, optimizer: Optimizers = None, *,
                accept: Callable[[Checkpoint], None] | None = None) -> Checkpoint:
        """Restore `latest` (from `latest()`) as `load_latest` restores the newest."""
        saved = latest.state
        if accept is not None:
            accept(Checkpoint(latest.step, saved["extra"], latest.path))
        if set(modules) != set(saved["modules"]):
            raise ValueError(f"checkpoint {latest.path} holds modules {sorted(saved['modules'])}, but "
                             f"{sorted(modules)} were given to restore")
        self._loaded = latest
        _scatter(modules, saved["modules"], None, None)
        for key, each in _keyed(optimizer).items():
            self.restore_optimizer(modules, each, key)
        return Checkpoint(latest.step, saved["extra"], latest.path)

    def restore_optimizer(self, modules: Modules, optimizer: DistributedOptimizer, key: str = _ONE) -> None:
        """Restore `optimizer` from the checkpoint `load_latest` loaded last, where it was saved under
        `key` (leave it out for an optimizer saved alone); `modules` name the parameters it steps
        (they are not restored again)."""
        if self._loaded is None:
            raise RuntimeError("restore_optimizer restores from the checkpoint load_latest loaded: call that first")
        saved = self._loaded.state["optimizers"]
        if key not in saved:
            raise ValueError(f"checkpoint {self._loaded.path} holds no optimizer saved as {key!r} (it holds "
                             f"{sorted(saved)}; an optimizer given alone is saved as {_ONE!r})")
        _scatter(modules, None, optimizer, saved[key])

    def wait(self) -> None:
        """Block until a background write has finished; raise its error if it failed."""
        self._store.wait()
