"""`LiveModules`: the RemoteModules of a model-parallel job driven from one worker (a pipeline's
stages, say), which outlive the workers they live on.

The driver runs each step through `run`. When a step fails because the owner of some module was
lost, the module is built again on a living host (a worker with none of the modules first: a
spare, or a replacement the driver added with `add_host`), every module and the optimizer's state
are put back as the newest replica or checkpoint holds them, and the step is run again, in the
same processes. The driver's RemoteModules are re-bound in place, so the code that calls them
does not change.

    live = LiveModules({"first": first, "second": second, "third": third},
                       optimizer=lambda params: DistributedOptimizer(torch.optim.SGD, params, lr=0.1),
                       replica=True)
    while live.step < steps:
        loss = live.run(train_step)   # train_step(context_id, step): forward and backward of that step

With `replica=True`, the driver copies every module's state and its optimizer's after every step
(nothing committed is lost); with `checkpoints` (every `every` steps), a recovery may go back to the
last checkpoint, and `step` with it: the data a step trains on must follow from its number.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shoal import autograd as dist_autograd
from shoal import config
from shoal.checkpoint.manager import Checkpoint
from shoal.checkpoint.model_parallel import ModelParallelCheckpoint
from shoal.errors import PeerFailure
from shoal.nn.remote_module import RemoteModule
from shoal.optim.distributed import DistributedOptimizer
from shoal.rpc import api as rpc
from shoal.rpc.current import current_agent
from shoal.rpc.rref import RRef

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recovery:
    """What one recovery did: the workers found lost, where each of their modules was built again,
    and the step the job went on from, restored from `source` (a checkpoint's path, or "memory")."""

    lost: list[str]
    moved: dict[str, str]
    step: int
    source: str


def _alive() -> bool:
    return True


class LiveModules:
    """`modules` (key -> RemoteModule), stepped by the DistributedOptimizer that `optimizer(params)`
    makes, in steps numbered from 0 (or from the latest of `checkpoints`). Modules may be built
    again on `hosts` (worker names; the modules' own workers unless given), and on workers given to
    `add_host` later. `extra` is the driver's own state (objects with `state_dict` and
    `load_state_dict`, such as a data position), saved and restored with the modules."""

    def __init__(self, modules: Mapping[str, RemoteModule],
                 optimizer: Callable[[list[RRef]], DistributedOptimizer], *, replica: bool = False,
                 checkpoints: ModelParallelCheckpoint | None = None, every: int = 0,
                 hosts: Sequence[str] | None = None, extra: Mapping[str, Any] | None = None) -> None:
        if not modules or not all(isinstance(module, RemoteModule) for module in modules.values()):
            raise TypeError(f"LiveModules takes one or more RemoteModules by key, got {dict(modules)}")
        if not replica and checkpoints is None:
            raise ValueError("LiveModules needs replica=True or checkpoints: with neither, a module built again "
                             "would start from its constructor's weights, and what it had learned would be lost")
        if checkpoints is not None and every < 1:
            raise ValueError(f"LiveModules with checkpoints needs every >= 1 (steps between them), got {every}")
        self.modules = dict(modules)
        self._make_optimizer = optimizer
        self._replica = ModelParallelCheckpoint.in_memory() if replica else None
        self._checkpoints, self._every = checkpoints, every
        self._extra = dict(extra or {})
        owners = [self._owner(module) for module in self.modules.values()]
        self._hosts = list(dict.fromkeys(hosts if hosts is not None else owners))
        for host in self._hosts:
            current_agent().worker(host)  # ValueError for a name no worker has
        self.step = 0
        self.recoveries: list[Recovery] = []
        self.optimizer = self._make_optimizer(self._parameters())
        latest = checkpoints.latest() if checkpoints is not None else None
        if latest is not None:
            self._restore(checkpoints, latest)
        if self._replica is not None:  # so that a loss in the first step finds what to restore
            self._replica.save(self.step, self.modules, self.optimizer, extra=self._extra_state())
        if checkpoints is not None and latest is None:
            checkpoints.save(self.step, self.modules, self.optimizer, extra=self._extra_state())

    def add_host(self, worker: str) -> None:
        """Let modules be built again on `worker` too (a replacement that joined the job): a host with
        none of the modules is chosen first."""
        current_agent().worker(worker)
        if worker not in self._hosts:
            self._hosts.append(worker)

    def run(self, train_step: Callable[[int, int], Any]) -> Any:
        """`train_step(context_id, step)` (the forward and backward of step `step`, in that distributed
        autograd context), then the optimizer's step; returns what `train_step` returned. If it fails
        because a module's owner was lost, recovers (see the module's doc) and runs the step the job
        goes on from, until one is committed. Any other error is raised; one in the optimizer's step,
        which some owners may have applied, after every module is put back as the newest source has it."""
        return self.call(self._step, train_step)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, a use of the modules outside a step (an evaluation, say): if it fails because a
        module's owner was lost, recovers as `run` does and calls it again."""
        while True:
            try:
                return fn(*args)
            except Exception as error:
                self._recover(error)

    # ---- steps and recovery -------------------------------------------------------------------------

    def _step(self, train_step: Callable[[int, int], Any]) -> Any:
        """One step, committed: its state replicated (with the optimizer's step, one call to each owner)
        and checkpointed when one is due. A loss during that checkpoint goes on from the replica, and
        the checkpoint waits for the next one due."""
        step = self.step + 1
        with dist_autograd.context() as context_id:
            result = train_step(context_id, self.step)
            try:
                if self._replica is not None:
                    self._replica.step_and_save(step, self.modules, self.optimizer, context_id,
                                                extra=self._extra_state())
                else:
                    self.optimizer.step(context_id)
            except Exception:
                if not self._lost_owners():  # applied on some owners only (one was slow): undo it, then raise
                    self._restore(*self._newest())
                raise
        self.step = step
        if self._checkpoints is not None and step % self._every == 0:
            self._checkpoints.save(step, self.modules, self.optimizer, extra=self._extra_state())
        return result

    def _extra_state(self) -> dict[str, Any]:
        return {key: value.state_dict() for key, value in self._extra.items()}

    def _recover(self, error: Exception) -> None:
        """Build the modules of lost owners again and restore the newest state, once more for each
        worker lost meanwhile; `error` is raised if no owner was lost, or the last try's error if it
        failed with no new loss."""
        lost_before: set[str] | None = None
        while True:
            lost = self._lost_owners()
            lost_now = {worker.name for worker in rpc.lost_workers()}
            if not lost or lost_now == lost_before:
                raise error
            lost_before = lost_now
            try:
                self._rebuild(lost)
                return
            except Exception as again:  # a host lost while it was rebuilt, say: see whether one was
                error = again

    def _lost_owners(self) -> list[str]:
        """The owners of modules that are lost. An error that a loss caused may reach this worker before
        it hears of the loss (through another worker), so each owner not known lost is asked."""
        agent = current_agent()
        owners = sorted({self._owner(module) for module in self.modules.values()})
        lost = [owner for owner in owners if agent.is_lost(owner)]
        if lost:
            return lost
        timeout = 2 * config.SHOAL_HEARTBEAT_TIMEOUT.get()  # a silent owner is declared lost within this
        asked = {owner: rpc.rpc_async(owner, _alive, timeout=timeout) for owner in owners}
        for owner, answer in asked.items():
            try:
                answer.wait()
            except PeerFailure:
                lost.append(owner)
            except TimeoutError:  # slow but there: not a loss
                continue
        return lost

    def _rebuild(self, lost: list[str]) -> None:
        source, latest = self._newest()
        moved = {}
        for key, module in self.modules.items():
            if self._owner(module) in lost:
                module.rebuild_on(self._place())
                moved[key] = self._owner(module)
        self.optimizer = self._make_optimizer(self._parameters())
        self._restore(source, latest)
        self.recoveries.append(Recovery(lost, moved, latest.step, str(latest.path)))

    def _newest(self) -> tuple[ModelParallelCheckpoint, Checkpoint]:
        """The newest of the replica and the latest checkpoint that verifies (once its write has
        finished; a write that failed leaves an older one)."""
        if self._checkpoints is not None:
            try:
                self._checkpoints.wait()
            except RuntimeError:
                log.exception("LiveModules: a checkpoint's write failed; recovering from an older one or the replica")
        found = [(source, latest) for source in (self._replica, self._checkpoints)
                 if source is not None and (latest := source.latest()) is not None]
        if not found:
            raise RuntimeError("LiveModules: no checkpoint verifies (see the warnings), and there is no replica: "
                               "nothing to build the lost modules again from")
        return max(found, key=lambda pair: pair[1].step)

    def _place(self) -> str:
        """The living host with the fewest modules (the first such in `hosts`)."""
        agent = current_agent()
        living = [host for host in self._hosts if not agent.is_lost(host)]
        if not living:
            raise RuntimeError(f"LiveModules: every host ({self._hosts}) is lost: nowhere to build the modules again")
        held = [self._owner(module) for module in self.modules.values()]
        return min(living, key=held.count)

    def _restore(self, source: ModelParallelCheckpoint, latest: Checkpoint) -> None:
        restored = source.restore(latest, self.modules, self.optimizer)
        for key, value in self._extra.items():
            value.load_state_dict(copy.deepcopy(restored.state[key]))
        self.step = restored.step

    def _parameters(self) -> list[RRef]:
        return [param for module in self.modules.values() for param in module.remote_parameters()]

    @staticmethod
    def _owner(module: RemoteModule) -> str:
        return module.get_module_rref().owner_name()
