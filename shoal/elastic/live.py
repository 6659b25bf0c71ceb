"""Live recovery: data-parallel training that goes on in the same processes when workers are lost.

    live = LiveTraining(net, optimizer, sampler)      # under `shoal run --live`
    for x, y in live.batches(loader):
        with live.step():
            loss_fn(live.model(x), y).backward()      # live.model: DDP over this generation's group
    # each step is applied (optimizer.step, sampler.commit) on every member, or on none

Each step ends with one decision kept in the job's store (decisions.py). A discarded step is taken
again, after the members still alive have agreed on the next generation (membership.py): DDP adopts
its group and the sampler shares the lost members' samples out, so every sample is trained exactly
once. What a discarded step's forward changed besides the gradients (BatchNorm's running statistics,
the random number generators) is not rolled back.
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from shoal.comm.store import Store
from shoal.data.elastic import ElasticSampler
from shoal.elastic.decisions import StepDecisions
from shoal.elastic.membership import Membership
from shoal.errors import GroupBrokenError, PeerFailure
from shoal.parallel import DistributedDataParallel

_LOSSES = (PeerFailure, GroupBrokenError)  # what ends a generation; anything else is the script's error
_trainings = itertools.count()


class LiveTraining:
    """One worker's part in a job with live recovery; `model` is the DDP replica to train."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, sampler: ElasticSampler, *,
                 timeout: timedelta = timedelta(seconds=60), **ddp_options: Any) -> None:
        if os.environ.get("SHOAL_LIVE") != "1" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            raise RuntimeError("live recovery needs a launcher that serves the store and keeps the other workers "
                               "running when one is lost: run the script under `shoal run --live`")
        host = os.environ["MASTER_ADDR"]
        store = Store.connect(host, int(os.environ["MASTER_PORT"]), world_size=int(os.environ["WORLD_SIZE"]),
                              is_server=False, timeout=timeout)
        # Every rank counts its trainings alike, so a second one in the job never reads the first one's keys.
        self._store = store.scoped(f"live/{next(_trainings)}/")
        me = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.membership = Membership(self._store.scoped("generations/"), me, host=host, timeout=timeout)
        self.generation = self.membership.first(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        self.group = self.membership.group(self.generation)
        self.model = DistributedDataParallel(module, process_group=self.group, **ddp_options)
        self.optimizer, self.sampler = optimizer, sampler
        sampler.set_membership(self.group.rank, self.group.size)
        self.steps = 0
        """Steps committed: what a learning-rate schedule should follow."""
        self._decisions = StepDecisions(self._store.scoped("steps/"), timeout)
        self._regrouped = False

    def batches(self, loader: Iterable) -> Iterator[Any]:
        """The loader's batches to the end of the epoch; after a change of generation, from the
        committed offset on, with the new members' shares. (A plain loop over the loader would end
        at the first change of generation.)"""
        while True:
            self._regrouped = False
            for batch in loader:
                yield batch
                if self._regrouped:
                    break
            else:
                return

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around forward and backward: then the step is applied on every member or discarded on all."""
        try:
            yield
        except _LOSSES as exc:
            loss: BaseException | None = exc
        except BaseException:
            self._decisions.discard(self._step_key())  # the others need not wait for us to time out
            raise
        else:
            loss = None
        try:
            if self._decide(reduced=loss is None):
                self.optimizer.step()
                self.sampler.commit()
                self.steps += 1
            else:
                self._regroup(loss)
        finally:
            self.optimizer.zero_grad()

    def _step_key(self) -> str:
        return f"{self.generation.number}/{self.steps}"

    def _decide(self, reduced: bool) -> bool:
        return self._decisions.decide(self._step_key(), self.generation.size, reduced=reduced, member_lost=lambda: any(
            self.group.transport.failure(r) is not None for r in range(self.generation.size)))

    def _regroup(self, loss: BaseException | None) -> None:
        """On to the next generation; to the one after, if a member is lost while DDP takes the new
        group's parameters. (A member lost while the new group's mesh connects ends in TimeoutError.)"""
        while True:
            before = self.generation
            self.generation = self.membership.next(before, self.group)
            if self.generation.members == before.members:
                raise RuntimeError(f"generation {before.number}'s step failed with no member lost: "
                                   f"{loss!r}") from loss
            self.group = self.membership.group(self.generation)
            try:
                self.model.adopt(self.group)
            except _LOSSES as exc:
                loss = exc
                continue
            break
        self.sampler.set_membership(self.group.rank, self.group.size)
        self._regrouped = True

    def close(self) -> None:
        self.group.shutdown()
