"""Live recovery: data-parallel training that goes on in the same processes when workers are lost, and
that workers join (restarted by their launcher, or new) without stopping the others.

    live = LiveTraining(net, optimizer, sampler)      # under `shoal run --live`
    for epoch in live.epochs(10):                     # a joiner starts at the epoch the others are in
        for x, y in live.batches(loader):
            with live.step() as step:
                loss_fn(live.model(x), y).backward()  # live.model: DDP over this generation's group
            if step.committed:                        # applied on every member; else on none, taken again
                scheduler.step()
    live.close()

Each step ends with one decision kept in the job's store (decisions.py). A discarded step is taken
again, after the members still alive have agreed on the next generation (membership.py): DDP adopts
its group and the sampler shares the lost members' samples out, so every sample is trained exactly
once. A worker whose launch rank is taken (it replaces a lost one) asks to join; the members admit it
after the next step that commits, in a new generation. Whenever the generation changes, every member
takes rank 0's parameters, buffers, optimizer state, data position and step count over the transport
(handover.py), so all hold the same state; a fully_shard model is cut again over the new members instead,
each block taken from a worker that holds it, its own or a buddy (shard_keeper.py). What a discarded
step's forward changed besides the gradients (BatchNorm's running statistics, the random number
generators) is not rolled back.

With an optimizer that synchronizes the replicas every few steps (DiLoCoOptimizer, PostLocalSGDOptimizer),
`model` is the module itself and the decision comes at each period's end (periods.py): a member lost during
a period undoes it on every member, `extra` included, and the next generation trains its samples again.

A script may train several times in turn (a LiveTraining each, closed before the next): each later
training begins with the last members of the one before, and a worker that missed one (it arrived
after the members closed it) passes through it and joins the next.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import itertools
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from shoal import config
from shoal.backoff import attempts
from shoal.comm.store import Store
from shoal.data.elastic import ElasticSampler
from shoal.elastic.decisions import DISCARD, GROW, StepDecisions
from shoal.elastic.handover import share_state
from shoal.elastic.identity import member_id
from shoal.elastic.membership import JOIN_WAIT, Generation, JobFinished, Membership
from shoal.elastic.periods import Periods
from shoal.elastic.shard_keeper import ShardKeeper, settings
from shoal.errors import GroupBrokenError, PeerFailure
from shoal.observe import events, timeline
from shoal.parallel import DistributedDataParallel, FSDPModule

_LOSSES = (PeerFailure, GroupBrokenError)  # what ends a generation; anything else is the script's error
_trainings = itertools.count()
_JOIN_POLL_S = 0.2  # how often a step's decision looks for joiners: a store round trip, not made every step


class Step:
    """What `live.step()` gives the loop. A discarded step returns to the loop like a committed one (the
    next generation takes it again), so code after the `with` block that counts steps (a scheduler's
    step, a log line, metrics) belongs under `if step.committed:`."""

    def __init__(self) -> None:
        self.committed = False
        """Applied on every member (optimizer.step, sampler.commit); False inside the block and when discarded.
        With a periodic optimizer (DiLoCo, post-local SGD), taken on every member, but undone if a member
        is lost before its period ends."""
        self.synchronized = False
        """Final: this step ended a period that every member synchronized, and the period's steps are
        committed for good. Under DDP and fully_shard, each step is a period: the same as `committed`."""


class LiveTraining:
    """One worker's part in a job with live recovery; `model` is the DDP replica to train, or, for a model
    `fully_shard` was called on, the model itself, re-sharded over each generation, each block also held by
    `redundancy` other workers (shard_keeper.py). `extra`: other objects with state_dict/load_state_dict (a
    learning-rate scheduler) that a joiner takes from the others with the optimizer's state. With fewer than
    `min_workers` members, the members wait for workers to join before they go on (TimeoutError if none
    asks to within `timeout`); by default, as many as MIN nodes of `shoal run --nnodes MIN:MAX` start, else 1.
    A DiLoCoOptimizer or PostLocalSGDOptimizer (made before any process group, as here) makes the training
    periodic: see the module's doc."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, sampler: ElasticSampler, *,
                 extra: Mapping[str, Any] | None = None, min_workers: int | None = None,
                 timeout: timedelta = timedelta(seconds=60), redundancy: int = 1, **ddp_options: Any) -> None:
        if min_workers is None:
            from_launcher = config.SHOAL_MIN_WORKERS.get()
            min_workers = 1 if from_launcher is None else from_launcher
        launched = config.WORLD_SIZE.get()
        if not 1 <= min_workers <= (min_workers if launched is None else launched):
            raise ValueError(f"min_workers must be between 1 and the launched world size "
                             f"({launched}), got {min_workers}")
        if not (config.SHOAL_LIVE.get() and config.TORCHELASTIC_USE_AGENT_STORE.get()):
            raise RuntimeError("live recovery needs a launcher that serves the store and keeps the other workers "
                               "running when one is lost: run the script under `shoal run --live`")
        self._periods = Periods.of(optimizer)
        if self._periods is not None and (isinstance(module, FSDPModule) or ddp_options):
            raise ValueError(f"{type(optimizer).__name__} synchronizes whole replicas every few steps: "
                             f"the model is neither wrapped in DDP nor fully_shard")
        timeline.start_from_environment()  # `shoal run --trace DIR`
        host = config.MASTER_ADDR.get()
        store = Store.connect(host, config.MASTER_PORT.get(), world_size=launched, is_server=False, timeout=timeout)
        # Every rank counts its trainings alike, so a second one in the job never reads the first one's keys.
        index, self._job = next(_trainings), store.scoped("live/")
        self._store = self._job.scoped(f"{index}/")
        self._store.set("begun", 1)  # a joiner that missed the training before goes on to this one
        self.membership = Membership(self._store.scoped("generations/"), member_id(), host=host, timeout=timeout)
        self.optimizer, self.sampler, self._extra = optimizer, sampler, dict(extra or {})
        self.min_workers, self._timeout = min_workers, timeout
        self.steps = 0
        """Steps committed (periodic: taken, and undone with their period): what a learning-rate schedule follows."""
        self._decisions = StepDecisions(self._store.scoped("steps/"), timeout)
        self._regrouped = False
        self._joiners_to_admit = False  # the last step's decision was GROW: admit them before the next step
        self._looked_for_joiners = time.monotonic()
        self._module, self._ddp_options = module, ddp_options
        self.model: DistributedDataParallel | nn.Module | None = None
        self._keeper: ShardKeeper | None = None
        self._period_start: dict[str, Any] | None = None  # what a period is undone to (None: take it at its start)
        if self._periods is not None:
            self.model = module
        if not isinstance(module, FSDPModule) and any(isinstance(m, FSDPModule) for m in module.modules()):
            raise ValueError("fully_shard was called on parts of this model but not on the whole: call it on the "
                             "model too (the root, which LiveTraining re-cuts over each generation)")
        if not isinstance(module, FSDPModule) and redundancy != 1:
            raise ValueError("redundancy is for a fully_shard model's blocks; a DDP replica is whole on every worker")
        if isinstance(module, FSDPModule):
            if ddp_options:
                raise TypeError(f"a fully_shard model is not wrapped in DDP: {sorted(ddp_options)} do not apply")
            self._keeper = ShardKeeper.of(module, optimizer, redundancy)
            self.model = module
        self.missed = False
        """The members finished this training before this worker could join it, and began a later one
        (which it joins): this one's loops yield nothing, and `model`, `group` and `generation` are None."""
        first = self._first_generation(index, launched, host)
        self._holds_state = first is not None  # a joiner holds the training state once rank 0 has shared it
        try:
            self.generation = first if first is not None else self.membership.join()
        except JobFinished:
            self._miss(index)
            return
        _mark_exit(self._job, self.membership.me)
        self.group = self.membership.group(self.generation)
        self._regroup(None, advance=False)

    def _first_generation(self, index: int, launched: int, host: str) -> Generation | None:
        """Generation 0 of this training, if this worker is in it (else it must join): in the job's first
        training, the workers launched, by launch rank (a worker whose rank is taken was started in place
        of a lost one, and a late node's workers join); in a later one, the last members of the one before
        (a late node's workers among them, once admitted)."""
        if index == 0:
            return None if config.SHOAL_JOINING.get() else self.membership.first(config.RANK.get(), launched)
        before = Membership(self._job.scoped(f"{index - 1}/generations/"), self.membership.me, host=host,
                            timeout=self._timeout).last_members()
        return Generation(0, before) if self.membership.me in before else None

    def _miss(self, index: int) -> None:
        """The members finished this training before this worker could join it: go on to the next one
        once they have begun it, or end (JobFinished) once they have all exited."""
        self.missed, self.model, self.generation, self.group = True, None, None, None
        members = self.membership.last_members()
        patience = max(self._timeout, JOIN_WAIT).total_seconds()
        for _ in attempts(time.monotonic() + patience, first=0.005, limit=0.1, factor=1.5):
            if self._job.has(f"{index + 1}/begun"):
                return
            if all(self._job.has(f"exited/{member}") for member in members):
                print("shoal: the others finished the job before this worker could join it", file=sys.stderr,
                      flush=True)
                raise JobFinished
        raise TimeoutError(f"{self.membership.me}: the members finished training {index} before this worker "
                           f"joined, and they neither began another nor exited within {patience:g}s")

    def epochs(self, count: int) -> Iterator[int]:
        """The epochs of 0..count-1 still to train, each begun on the sampler (`set_epoch`), except the
        one in progress: a joiner goes on with the others' epoch where they are."""
        for epoch in range(self.sampler.epoch, 0 if self.missed else count):
            if epoch != self.sampler.epoch:
                self.sampler.set_epoch(epoch)
            yield epoch

    def batches(self, loader: Iterable) -> Iterator[Any]:
        """The loader's batches to the end of the epoch; after a change of generation, from the
        committed offset on, with the new members' shares. (A plain loop over the loader would end
        at the first change of generation.) Joiners are admitted here, after the script's code that
        follows a committed step (a scheduler's step) has run, so they receive the state it left."""
        while not self.missed:
            self._regrouped = False
            for batch in loader:
                yield batch
                self._admit_joiners()
                if self._regrouped:
                    break
            else:
                self._admit_joiners()
                return

    @contextmanager
    def step(self) -> Iterator[Step]:
        """Around forward and backward: then the step is applied on every member or discarded on all
        (`step.committed` says which)."""
        if self.missed:
            raise RuntimeError("the members finished this training before this worker could join it "
                               "(live.missed): it has no steps to take")
        if self._periods is not None and self._period_start is None:  # after the script's code for the last period
            self._period_start = copy.deepcopy(self._state())
        step, decides = Step(), True
        try:
            yield step
            if self._keeper is not None:
                self._keeper.send_gradients(self.group)
            decides = self._periods is None or self._local_step()
        except _LOSSES as exc:
            loss: BaseException | None = exc
        except BaseException:
            self._decisions.discard(self._step_key())  # the others need not wait for us to time out
            raise
        else:
            loss = None
        try:
            if not decides:
                step.committed = True
                return
            decision = self._decide(reduced=loss is None)
            if decision == DISCARD:
                if self._periods is not None:  # back to where the period began, as every member goes
                    self._periods.end()
                    self._load(self._period_start)
                self._regroup(loss)
                return
            if self._periods is None:
                self.optimizer.step()
                self.steps += 1
            if self._keeper is not None:
                self._keeper.commit()
            for _ in range(1 if self._periods is None else self._periods.end()):
                self.sampler.commit()
            step.committed = step.synchronized = True
            self._joiners_to_admit = decision == GROW
            self._period_start = None
        finally:
            self.optimizer.zero_grad()
            if self._keeper is not None:
                self._keeper.drop_gradients()

    def _local_step(self) -> bool:
        """A periodic optimizer's step on this replica; whether it ended the period, which is then
        synchronized (a collective: it fails if a member is lost)."""
        ends = self._periods.step(self.sampler)
        self.steps += 1
        if ends:
            self._periods.synchronize()
        return ends

    def _step_key(self) -> str:
        """The step decided on: with periods, the period's first (where every member's steps agree)."""
        return f"{self.generation.number}/{self.steps - (0 if self._periods is None else self._periods.taken)}"

    def _decide(self, reduced: bool) -> str:
        return self._decisions.decide(self._step_key(), self.generation.size, reduced=reduced, member_lost=lambda: bool(
            self.group.failed_ranks()), joiners_waiting=self._joiners_waiting)

    def _joiners_waiting(self) -> bool:
        now = time.monotonic()
        if now - self._looked_for_joiners < _JOIN_POLL_S:
            return False
        self._looked_for_joiners = now
        return self.membership.joiners_waiting(self.generation)

    def _admit_joiners(self) -> None:
        if self._joiners_to_admit:
            self._joiners_to_admit = False
            self._regroup(None)

    def _regroup(self, loss: BaseException | None, *, advance: bool = True) -> None:
        """On to the next generation, after `loss` (None: to admit joiners), or (`advance` False) into
        this one; to the one after, if a member is lost while the group takes rank 0's state, or if the
        generation is smaller than `min_workers` (once workers ask to join). (A member lost while the
        new group's mesh connects ends in TimeoutError.)"""
        regrouping, cause = events.begin(), "a member lost" if loss is not None else "workers joining"
        while True:
            if advance:
                before = self.generation
                self.generation = self.membership.next(before, self.group)
                if loss is not None and set(before.members) <= set(self.generation.members):
                    raise RuntimeError(f"generation {before.number}'s step failed with no member lost: "
                                       f"{loss!r}") from loss
                self.group = self.membership.group(self.generation)
            advance = True
            try:
                self._enter()
            except _LOSSES as exc:
                loss = exc
                continue
            if self.generation.size >= self.min_workers:
                break
            self._await_joiners()
            loss = None
        self._regrouped = True
        events.complete(f"generation {self.generation.number}", events.MEMBERSHIP, regrouping,
                        members=list(self.generation.members), cause=cause)

    def _await_joiners(self) -> None:
        if self.group.rank == 0:
            print(f"shoal: generation {self.generation.number} has {self.generation.size} workers, fewer than "
                  f"min_workers={self.min_workers}; waiting up to {self._timeout.total_seconds():g}s for workers "
                  f"to join", file=sys.stderr, flush=True)
        deadline = time.monotonic() + self._timeout.total_seconds()
        for _ in attempts(deadline, first=0.005, limit=0.1, factor=1.5):
            if self.membership.joiners_waiting(self.generation):
                return
        self.group.shutdown()
        raise TimeoutError(f"generation {self.generation.number}: {self.generation.size} workers, fewer than "
                           f"min_workers={self.min_workers}, and none joined within {self._timeout.total_seconds():g}s")

    def _enter(self) -> None:
        """Take part in this generation's group: DDP (or a periodic optimizer) over it, and rank 0's parameters,
        buffers and state; or, for a fully_shard model, its blocks re-cut over the group, and rank 0's buffers
        and state."""
        if self.group.rank == 0 and not self._holds_state:
            raise RuntimeError(f"generation {self.generation.number}: every worker that held the training state "
                               f"was lost; only workers still joining are left")
        if self._keeper is not None:
            self._keeper.reshard(self.group, self.generation.members, self._holds_state)
        elif self._periods is not None:
            self._periods.adopt(self.group)
        elif self.model is None:
            self.model = DistributedDataParallel(self._module, process_group=self.group, **self._ddp_options)
        else:
            self.model.adopt(self.group)
        state = share_state(self.group, self._state() if self.group.rank == 0 else None)
        if self.group.rank != 0:
            self._load(state)
        self._holds_state = True
        self.sampler.set_membership(self.group.rank, self.group.size)
        self._period_start = None

    def _load(self, state: dict[str, Any]) -> None:
        """Take `state`, as `_state` gives it."""
        if self._keeper is None:
            self.optimizer.load_state_dict(state["optimizer"])
        else:  # the shards' optimizer state was re-cut with them
            for group, saved in zip(self.optimizer.param_groups, state["settings"], strict=True):
                group.update(saved)
            for name, buffer in self._module.named_buffers():
                buffer.copy_(state["buffers"][name])
        if "module" in state:  # a periodic optimizer's replica, which no DDP broadcasts
            self._module.load_state_dict(state["module"])
        self.sampler.load_state_dict(state["sampler"])
        for name, obj in self._extra.items():
            obj.load_state_dict(state["extra"][name])
        self.steps = state["steps"]

    def _state(self) -> dict[str, Any]:
        state = {"sampler": self.sampler.state_dict(), "steps": self.steps,
                 "extra": {name: obj.state_dict() for name, obj in self._extra.items()}}
        if self._keeper is None:
            state["optimizer"] = self.optimizer.state_dict()
            if self._periods is not None:
                state["module"] = self._module.state_dict()
        else:
            state["settings"] = [settings(group) for group in self.optimizer.param_groups]
            state["buffers"] = dict(self._module.named_buffers())
        return state

    def close(self) -> None:
        """Training is over: `model` averages gradients no more (a fully_shard model's group is shut down:
        evaluate or save before), and workers still waiting to join go on to the next training, or end
        (JobFinished) when the members exit."""
        if not self.missed:
            self.membership.finish(self.generation)
            if isinstance(self.model, DistributedDataParallel):
                self.model.release()  # a later training may wrap the same module
            self.group.shutdown()


_exits_marked: set[str] = set()  # the members in this process whose exit will be marked


def _mark_exit(job: Store, member: str) -> None:
    """Once per process: mark its exit in the job's store, so that a joiner that missed the last training
    ends rather than waiting for another."""
    if member not in _exits_marked:
        _exits_marked.add(member)
        atexit.register(_exited, job, member)


def _exited(job: Store, member: str) -> None:
    with contextlib.suppress(Exception):  # the store is gone: nobody is left to tell
        job.set(f"exited/{member}", 1)
