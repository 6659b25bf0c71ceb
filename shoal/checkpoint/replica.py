"""Live replicas of a model-parallel job's state: a ModelParallelCheckpoint kept in the memory of
other workers instead of on disk, cheap enough to take after every optimizer step. When the owner of
the parameters is lost, a worker that holds its replica makes them again with nothing lost.

    replicas = ModelReplicas("ps", workers=["trainer1"])
    replicas.save(step, {"model": model_rref}, optimizer)    # returns once trainer1 holds this step
    ...                                                     # on trainer1, once the owner is lost:
    latest = ModelReplicas("ps").load_latest({"model": rpc.RRef(model)}, optimizer)

Each worker keeps the newest state saved to it under each name until it is restored from (or its
process ends). `latest(among=[...])` finds the newest that this worker or any of those holds, for a
worker that takes the owner's place without knowing which replica was sent last.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from shoal.checkpoint.manager import Checkpoint
from shoal.checkpoint.model_parallel import ModelParallelCheckpoint, Modules, Optimizers, call_on
from shoal.errors import PeerFailure
from shoal.rpc import api as rpc

_held: dict[str, Checkpoint] = {}  # on a replica's worker: name -> the newest state saved to it
_held_lock = threading.Lock()


class ReplicaLost(RuntimeError):
    """Some workers could not take a replica (they died or left, or the call failed there)."""

    def __init__(self, name: str, failures: dict[str, Exception]) -> None:
        self.workers, self.failures = sorted(failures), failures
        super().__init__(f"the replica {name!r} could not be kept on "
                         + ", ".join(f"{worker} ({error!r})" for worker, error in sorted(failures.items())))


def _hold(name: str, step: int, state: dict[str, Any], worker: str) -> None:
    """Runs on a replica's worker: keep `state`, in place of what `name` held."""
    with _held_lock:
        _held[name] = Checkpoint(step, state, f"the replica {name!r} on {worker}")


def _held_step(name: str) -> int | None:
    with _held_lock:
        return _held[name].step if name in _held else None


def _held_copy(name: str) -> Checkpoint | None:
    with _held_lock:
        return _held.get(name)


class _OnWorkers:
    """The store of `ModelReplicas`: each save is sent to every one of `workers`, and returns once
    each holds it (no copy is then older than what `save` returned from)."""

    def __init__(self, name: str, workers: Sequence[str]) -> None:
        self.name, self.workers = name, list(workers)

    def save(self, step: int, state: dict[str, Any]) -> None:
        futures = {worker: call_on(worker, _hold, (self.name, step, state, worker)) for worker in self.workers}
        failures = {}
        for worker, future in futures.items():
            try:
                future.wait()
            except Exception as exc:
                failures[worker] = exc
        if failures:
            raise ReplicaLost(self.name, failures)

    def load_latest(self) -> Checkpoint | None:
        with _held_lock:
            return _held.get(self.name)

    def wait(self) -> None:
        """Saves are synchronous: nothing is left to wait for."""


class ModelReplicas(ModelParallelCheckpoint):
    """A ModelParallelCheckpoint whose `save` sends the state to `workers` (which may change between
    saves), and whose `load_latest` restores the copy that this worker holds under `name` (None if
    it holds none). A save that some worker could not take raises ReplicaLost naming them, once the
    others hold it."""

    def __init__(self, name: str, workers: Sequence[str] = ()) -> None:  # no directory: no super().__init__
        self._store = _OnWorkers(name, ())
        self._loaded = None
        self.workers = workers

    def held_step(self) -> int | None:
        """The step of the replica this worker holds under this name, or None."""
        return _held_step(self._store.name)

    def latest(self, among: Sequence[str] = ()) -> Checkpoint | None:
        """The newest replica, as saved, that this worker or any of the workers `among` holds (this
        worker's if it is as new as theirs); a worker that cannot answer is passed over."""
        steps = {rpc.get_worker_info().name: self.held_step()}
        asked = {worker: rpc.rpc_async(worker, _held_step, args=(self._store.name,)) for worker in among}
        for worker, future in asked.items():
            try:
                steps[worker] = future.wait()
            except PeerFailure:  # lost meanwhile: what it held is gone with it
                continue
        here = rpc.get_worker_info().name
        holders = sorted((worker for worker, step in steps.items() if step is not None),
                         key=lambda worker: (-steps[worker], worker != here))  # the newest; of equals, here
        for worker in holders:
            try:
                copy = _held_copy(self._store.name) if worker == here else \
                    rpc.rpc_sync(worker, _held_copy, args=(self._store.name,))
            except PeerFailure:  # lost since it answered
                continue
            if copy is not None:  # None: restored from, and let go, since it answered
                return copy
        return None

    def restore(self, latest: Checkpoint, modules: Modules, optimizer: Optimizers = None, *,
                accept: Callable[[Checkpoint], None] | None = None) -> Checkpoint:
        """As a checkpoint's; a copy this worker held is then let go (it is restored: a later owner's
        replicas are newer)."""
        restored = super().restore(latest, modules, optimizer, accept=accept)
        with _held_lock:
            if _held.get(self._store.name) is latest:
                del _held[self._store.name]
        return restored

    @property
    def workers(self) -> list[str]:
        return list(self._store.workers)

    @workers.setter
    def workers(self, workers: Sequence[str]) -> None:
        here = rpc.get_worker_info().name
        if here in workers:
            raise ValueError(f"ModelReplicas: a replica on its own worker ({here!r}) would be lost with it")
        self._store.workers = list(workers)
