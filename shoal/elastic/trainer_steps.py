"""`TrainerSteps`: synchronous steps of trainers that share a model over RPC (a parameter server's),
which go on when trainers are lost.

It lives on one worker. It deals each epoch's samples out as batches, one per trainer per step,
runs every trainer's optimizer step once all of them have finished their backward, and records a
batch as applied once its step has been. A trainer that dies or leaves is not waited for: unless
its step was applied, its batch goes to another trainer, so every sample is trained on exactly
once per epoch, and the survivors go on in the same processes. Exactly once needs the parameters
on one worker (a parameter server's): a step that fails on one of several owners may have been
applied on the others.

    steps = rpc.rpc_sync("ps", make_steps)         # an RRef to the TrainerSteps on the server
    while (batch := steps.rpc_sync().next_batch(name)) is not None:
        with dist_autograd.context() as context_id:
            loss = loss_fn(model(images[batch.indices]), labels[batch.indices])
            dist_autograd.backward(context_id, [loss])
            steps.rpc_sync().step(batch, optimizer, context_id)
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shoal.checkpoint.manager import Checkpoint
from shoal.checkpoint.model_parallel import ModelParallelCheckpoint, Modules
from shoal.checkpoint.replica import ModelReplicas, ReplicaLost
from shoal.errors import PeerFailure
from shoal.optim.distributed import DistributedOptimizer
from shoal.rpc.current import current_agent
from shoal.rpc.functions import async_execution

_Answer = tuple[torch.futures.Future, Any]  # a waiting trainer's future, and its value (an exception: raised there)
_REPLICA = "shoal.elastic.TrainerSteps"  # the name its replicas are held under
_FORMAT = 2  # of the place it saves: batches by their part in the epoch's order


@dataclass(eq=False, frozen=True)
class Batch:
    """One trainer's share of one step: the positions of its samples in the data set (`indices`),
    which are the `part`-th batch of the epoch's order."""

    epoch: int
    step: int
    trainer: str
    indices: torch.Tensor
    part: int


class TrainerSteps:
    """Steps of `trainers` (worker names) over `samples` samples, `batch_size` per trainer per step, for
    `epochs` epochs, each in the order `torch.randperm` draws from `seed + epoch`. `applied` lists
    the batches whose steps were applied, in the order they were: which trainer gets which batch
    depends on timing, so a run is reproduced by replaying `applied`, not by running it again.
    `resumed` is the checkpoint or replica it started from (its step and path), or None.

    With `checkpoints` and `every`, it saves `modules`, the optimizers of the living trainers and its
    own place in the epochs after every `every`-th step, while the trainers of that step wait (a
    point where no step runs); and it starts from the latest of those checkpoints if there is one.
    So a server that is lost can be made again on another worker, which goes on from its last
    checkpoint: the steps since are lost, and their batches are dealt out again. With `replicas=k`,
    it also sends all of that to the first k living trainers (in the order of `trainers`) after
    every step, before any trainer hears that its step is applied; a server made again on one of
    them starts from there, and nothing is lost. Each trainer's optimizer is restored at its first
    step there; one that has not stepped there yet is left out of the checkpoints and replicas taken
    meanwhile. A checkpoint or replica of another run (other samples, batch size, epochs or seed) is
    refused."""

    def __init__(self, trainers: Sequence[str], *, samples: int, batch_size: int, epochs: int, seed: int = 0,
                 checkpoints: ModelParallelCheckpoint | None = None, modules: Modules | None = None,
                 every: int = 0, replicas: int = 0) -> None:
        if not trainers or len(set(trainers)) != len(trainers):
            raise ValueError(f"TrainerSteps needs one or more trainers, each named once, got {list(trainers)}")
        if samples < 1 or batch_size < 1 or epochs < 1:
            raise ValueError(f"TrainerSteps needs samples, batch_size and epochs of at least 1, "
                             f"got samples={samples}, batch_size={batch_size}, epochs={epochs}")
        if checkpoints is not None and (not modules or every < 1):
            raise ValueError(f"TrainerSteps with checkpoints needs the modules to save and every >= 1, got "
                             f"modules={modules}, every={every}")
        if replicas < 0 or (replicas and not modules):
            raise ValueError(f"TrainerSteps with replicas needs the modules to replicate, and replicas >= 0, got "
                             f"modules={modules}, replicas={replicas}")
        agent = current_agent()
        for trainer in trainers:
            agent.worker(trainer)  # ValueError for a name no worker has, which would be waited for forever
        self._trainers, self._order, self._here = frozenset(trainers), list(trainers), agent.name
        self._samples, self._batch_size, self._epochs, self._seed = samples, batch_size, epochs, seed
        self._lock = threading.Lock()
        self._living = set(trainers)
        self._epoch, self._step = -1, 0
        self._parts: list[torch.Tensor] = []  # this epoch's batches, in its order
        self._pending: deque[int] = deque()  # the parts that no trainer holds or has applied
        self._holding: dict[str, Batch] = {}  # computing this step's forward and backward
        self._arrived: dict[str, tuple[Batch, DistributedOptimizer, int, torch.futures.Future]] = {}
        self._idle: dict[str, torch.futures.Future] = {}  # asked for a batch when none was left this step
        self._applying = False
        self._finished = threading.Event()
        self._error: str | None = None
        self.applied: list[Batch] = []
        self._record: list[tuple[int, int, str, int]] = []  # `applied` as a checkpoint keeps it: by parts
        self._checkpoints, self._modules, self._every = checkpoints, modules or {}, every
        self._stepped: dict[str, DistributedOptimizer] = {}  # each trainer's, as of its latest step
        self._optimizers: dict[str, DistributedOptimizer] = {}  # ... as of its latest step applied
        self._replicas, self._replica_count = ModelReplicas(_REPLICA) if replicas else None, replicas
        self._resumed_from: ModelParallelCheckpoint | None = None
        self.resumed: Checkpoint | None = None
        self._unrestored: set[str] = set()  # trainers whose optimizers that holds
        if not self._resume():
            self._start_epoch()
        agent.on_worker_lost(lambda worker: threading.Thread(
            target=self._lose, args=(worker.name,), daemon=True, name="shoal-trainer-lost").start())
        for trainer in trainers:
            if agent.is_lost(trainer):  # lost before we listened
                self._lose(trainer)

    # ---- what trainers call (through an RRef) ----------------------------------------------------

    @async_execution
    def next_batch(self, trainer: str) -> torch.futures.Future:
        """`trainer`'s batch of the next step, or None once every epoch is trained. Answers once
        the step before has been applied for every trainer in it (and replicated, and checkpointed
        when due): call it with an RPC timeout longer than a step of the slowest trainer and a
        checkpoint."""
        future: torch.futures.Future = torch.futures.Future()
        with self._lock:
            self._check_free(trainer)
            self._idle[trainer] = future
            answers = self._advance()
        _answer(answers)
        return future

    @async_execution
    def step(self, batch: Batch, optimizer: DistributedOptimizer, context_id: int) -> torch.futures.Future:
        """Apply `optimizer.step(context_id)` (the trainer's backward of `batch` is done) once every
        trainer of this step has called; answers when all of their steps are applied, with the
        error of this trainer's step if it failed (its batch then goes back to the others)."""
        future: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self._error:
                raise RuntimeError(self._error)
            held = self._holding.get(batch.trainer)
            if held is None or held.step != batch.step:
                raise RuntimeError(f"TrainerSteps.step: trainer {batch.trainer!r} holds no batch of step {batch.step}")
            del self._holding[batch.trainer]
            self._arrived[batch.trainer] = (held, optimizer, context_id, future)
            self._stepped[batch.trainer] = optimizer
            answers = self._advance()
        _answer(answers)
        return future

    def add_trainer(self, trainer: str) -> None:
        """Take `trainer` on, a worker that joined the job (a lost trainer's replacement, say): it
        gets its batches as the others do, from the next step it asks for (it should ask at once: the
        step under way waits for it). Its optimizer starts afresh. After the training's end, its
        first `next_batch` answers None."""
        agent = current_agent()
        agent.worker(trainer)  # ValueError for a name no worker has
        with self._lock:
            if trainer in self._trainers:
                raise ValueError(f"TrainerSteps: {trainer!r} is a trainer already")
            self._trainers = self._trainers | {trainer}
            self._living.add(trainer)
            self._order.append(trainer)
            if agent.is_lost(trainer):  # lost before this: no listener will tell of it again
                self._living.discard(trainer)

    # ---- for the worker it lives on ----------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        """Block until every epoch is trained; RuntimeError if every trainer was lost first."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"TrainerSteps: training did not finish within {timeout} s")
        if self._error is not None:
            raise RuntimeError(self._error)

    # ---- the steps -----------------------------------------------------------------------------------

    def _check_free(self, trainer: str) -> None:
        if trainer not in self._trainers:
            raise ValueError(f"TrainerSteps: {trainer!r} is not one of the trainers {sorted(self._trainers)}")
        if trainer not in self._living:
            raise RuntimeError(f"TrainerSteps: trainer {trainer!r} was lost; it cannot take part again")
        if trainer in self._holding or trainer in self._arrived or trainer in self._idle:
            raise RuntimeError(f"TrainerSteps: trainer {trainer!r} asked for a batch before finishing its step")

    def _resume(self) -> bool:
        """Start from the newest of a lost server's replicas (on this worker or a living trainer) and its
        latest checkpoint, if there is any: the modules now, the trainers' optimizers at their first
        steps."""
        agent, found = current_agent(), []
        if self._replicas is not None:
            others = [name for name in self._order if name != self._here and not agent.is_lost(name)]
            found.append((self._replicas, self._replicas.latest(among=others)))
        if self._checkpoints is not None:
            found.append((self._checkpoints, self._checkpoints.latest()))
        found = [(source, latest) for source, latest in found if latest is not None]
        if not found:
            return False
        source, latest = max(found, key=lambda each: each[1].step)  # the replica, of equals: nothing to read
        latest = source.restore(latest, self._modules, accept=self._check_run)
        place = latest.state["trainer_steps"]
        self._epoch, self._step = place["epoch"], place["step"]
        self._parts = self._batches(self._epoch)
        self._pending.extend(place["pending"])
        self._record, batches = list(place["applied"]), {}
        for epoch, step, trainer, part in self._record:
            if epoch not in batches:
                batches[epoch] = self._batches(epoch)
            self.applied.append(Batch(epoch, step, trainer, batches[epoch][part], part))
        self._resumed_from, self._unrestored, self.resumed = source, set(place["optimizers"]), latest
        return True

    def _check_run(self, latest: Checkpoint) -> None:
        place = latest.state.get("trainer_steps")
        if place is None or place["run"] != self._run():
            raise ValueError(f"TrainerSteps: {latest.path} is not of this run "
                             f"({place['run'] if place else 'no TrainerSteps in it'}, not {self._run()}): "
                             f"give each run a directory of its own")

    def _run(self) -> dict[str, int]:
        return {"samples": self._samples, "batch_size": self._batch_size, "epochs": self._epochs, "seed": self._seed,
                "format": _FORMAT}

    def _place(self) -> dict[str, Any]:
        """Under the lock, between two steps: where the epochs stand, as a checkpoint or replica keeps it
        (batches by their parts, which `_batches` makes again: a few numbers each), with the optimizers
        of the living trainers that have stepped here."""
        return {"run": self._run(), "epoch": self._epoch, "step": self._step, "pending": list(self._pending),
                "applied": list(self._record),
                "optimizers": sorted(name for name in self._optimizers if name in self._living)}

    def _batches(self, epoch: int) -> list[torch.Tensor]:
        """The batches of `epoch`, in the order `torch.randperm` draws from `seed + epoch`."""
        order = torch.randperm(self._samples, generator=torch.Generator().manual_seed(self._seed + epoch))
        return list(order.split(self._batch_size))

    def _start_epoch(self) -> None:
        self._epoch += 1
        self._parts = self._batches(self._epoch)
        self._pending.extend(range(len(self._parts)))

    def _advance(self) -> list[_Answer]:
        """Under the lock: deal batches to idle trainers, and apply the step once every living
        trainer has arrived or has nothing to do; the futures to answer, outside the lock."""
        answers: list[_Answer] = []
        if self._finished.is_set():  # done, or failed: nobody waits any longer
            failed = RuntimeError(self._error) if self._error else None
            answers += [(future, failed) for future in self._idle.values()]
            answers += [(future, failed) for _, _, _, future in self._arrived.values()]
            self._idle.clear()
            self._arrived.clear()
            return answers
        if self._applying:
            return answers
        while self._idle and self._pending:
            trainer, future = self._idle.popitem()
            part = self._pending.popleft()
            batch = Batch(self._epoch, self._step, trainer, self._parts[part], part)
            self._holding[trainer] = batch
            answers.append((future, batch))
        due = self._living - self._holding.keys() - self._arrived.keys() - self._idle.keys()
        if due or self._holding:
            return answers
        if self._arrived:
            self._applying = True
            threading.Thread(target=self._apply, args=(sorted(self._arrived.items()),), daemon=True,
                             name="shoal-trainer-steps").start()
            return answers
        more_epochs = self._epoch + 1 < self._epochs
        if not self._living and (self._pending or more_epochs):  # nobody is left to train what is left
            self._error = (f"TrainerSteps: every trainer was lost in epoch {self._epoch}, step {self._step}, "
                           f"with {len(self._pending)} batches of it untrained")
            self._finished.set()
            return answers
        if more_epochs:  # every living trainer waits, and this epoch is all applied
            self._start_epoch()
            return answers + self._advance()
        answers += [(future, None) for future in self._idle.values()]
        self._idle.clear()
        self._finished.set()
        return answers

    def _apply(self, arrived: list[tuple[str, tuple[Batch, DistributedOptimizer, int, torch.futures.Future]]]) -> None:
        """One step: each trainer's optimizer step in turn (in name order, so a run can be replayed)."""
        outcomes = []
        for _, (batch, optimizer, context_id, future) in arrived:
            try:
                if batch.trainer in self._unrestored:
                    self._resumed_from.restore_optimizer(self._modules, optimizer, batch.trainer)
                    self._unrestored.discard(batch.trainer)
                optimizer.step(context_id)
            except Exception as exc:  # a lost trainer's context is gone: its step did not apply
                outcomes.append((batch, future, exc))
            else:
                outcomes.append((batch, future, None))
        try:
            self._settle(outcomes)
        except BaseException as exc:  # never leave the trainers waiting for a step that will not end
            answers = self._fail(f"TrainerSteps: settling step {self._step} failed: {exc!r}")
            _answer([(future, value) for future, value in answers if not future.done()])
            raise

    def _settle(self, outcomes: list[tuple[Batch, torch.futures.Future, Exception | None]]) -> None:
        """The step's outcomes recorded, its replicas and a checkpoint if one is due taken (still
        `_applying`, so no batch is dealt and no step starts meanwhile), then the trainers answered."""
        answers: list[_Answer] = []
        with self._lock:
            for batch, future, error in outcomes:
                del self._arrived[batch.trainer]
                if error is None:
                    self.applied.append(batch)
                    self._record.append((batch.epoch, batch.step, batch.trainer, batch.part))
                    self._optimizers[batch.trainer] = self._stepped[batch.trainer]
                else:
                    self._pending.appendleft(batch.part)
                if batch.trainer in self._living:
                    answers.append((future, error))
            self._step += 1
            due = self._checkpoints is not None and self._step % self._every == 0
            place = self._place() if due or self._replicas is not None else None
            if place is None:
                self._applying = False
                answers += self._advance()
        if place is not None:  # the trainers of this step wait for their answers: no step runs
            optimizers = {name: self._optimizers[name] for name in place["optimizers"]}
            try:
                if self._replicas is not None:
                    self._replicate(place, optimizers)
                if due:
                    self._checkpoints.save(place["step"], self._modules, optimizers, extra={"trainer_steps": place})
            except Exception as exc:  # training on would lose, unseen, what the next server needs
                failed = self._fail(f"TrainerSteps: saving step {place['step']} failed: {exc!r}")
                answers = [(future, RuntimeError(self._error)) for future, _ in answers] + failed
            else:
                with self._lock:
                    self._applying = False
                    answers += self._advance()
        _answer(answers)

    def _replicate(self, place: dict[str, Any], optimizers: dict[str, DistributedOptimizer]) -> None:
        """This step's state to the first `replicas` trainers not lost (not this worker): a trainer lost
        meanwhile is passed over for the next, in this step, so the first living trainers hold it."""
        agent, passed_over = current_agent(), set()
        with self._lock:
            order = [name for name in self._order if name != self._here]
        for _ in range(len(order) + 1):  # each try passes over one more worker, or is the last
            living = [name for name in order if name not in passed_over and not agent.is_lost(name)]
            self._replicas.workers = living[:self._replica_count]
            try:
                self._replicas.save(place["step"], self._modules, optimizers, extra={"trainer_steps": place})
                return
            except ReplicaLost as exc:  # one that lives without it would make a next server start from older
                if not all(isinstance(error, PeerFailure) and error.rank == agent.worker(worker).id
                           for worker, error in exc.failures.items()):
                    raise
                passed_over.update(exc.workers)

    def _fail(self, error: str) -> list[_Answer]:
        """End the training with `error`, which every trainer that waits, or comes to, is told."""
        with self._lock:
            self._error = error
            self._finished.set()
            return self._advance()

    def _lose(self, trainer: str) -> None:
        """A worker died or left: if it was a trainer, its batch not applied goes back to the others."""
        with self._lock:
            if trainer not in self._living:
                return
            self._living.discard(trainer)
            self._idle.pop(trainer, None)
            if trainer in self._holding:
                self._pending.appendleft(self._holding.pop(trainer).part)
            if trainer in self._arrived and not self._applying:  # an applying step settles it itself
                self._pending.appendleft(self._arrived.pop(trainer)[0].part)
            answers = self._advance()
        _answer(answers)


def _answer(answers: list[_Answer]) -> None:
    for future, value in answers:
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)
