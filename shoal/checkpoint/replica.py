"""Live replicas of a model-parallel job's state: a ModelParallelCheckpoint kept in the memory of
other workers instead of on disk, cheap enough to take after every optimizer step. When the owner of
the parameters is lost, a worker that holds its replica makes them again with nothing lost.

    replicas = ModelReplicas("ps", workers=["trainer1"])
    replicas.save(step, {"model": model_rref}, optimizer)    # returns once trainer1 holds this step
    ...                                                     # on trainer1, once the owner is lost:
    latest = ModelReplicas("ps").load_latest({"model": rpc.RRef(model)}, optimizer)

Each worker keeps the newest state saved to it under each name, for as long as its process lives.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from shoal.checkpoint.manager import Checkpoint
from shoal.checkpoint.model_parallel import ModelParallelCheckpoint, call_on
from shoal.rpc import api as rpc

_held: dict[str, Checkpoint] = {}  # on a replica's worker: name -> the newest state saved to it
_held_lock = threading.Lock()


class ReplicaLost(RuntimeError):
    """Some workers could not take a replica (they died or left, or the call failed there)."""

    def __init__(self, name: str, failures: dict[str, Exception]) -> None:
        self.workers = sorted(failures)
        super().__init__(f"the replica {name!r} could not be kept on "
                         + ", ".join(f"{worker} ({error!r})" for worker, error in sorted(failures.items())))


def _hold(name: str, step: int, state: dict[str, Any], worker: str) -> None:
    """Runs on a replica's worker: keep `state`, in place of what `name` held."""
    with _held_lock:
        _held[name] = Checkpoint(step, state, f"the replica {name!r} on {worker}")


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
        latest = self._store.load_latest()
        return None if latest is None else latest.step

    @property
    def workers(self) -> list[str]:
        return list(self._store.workers)

    @workers.setter
    def workers(self, workers: Sequence[str]) -> None:
        here = rpc.get_worker_info().name
        if here in workers:
            raise ValueError(f"ModelReplicas: a replica on its own worker ({here!r}) would be lost with it")
        self._store.workers = list(workers)
