"""Live recovery: data-parallel training that goes on in the same processes when workers are lost.

    live = LiveTraining(net, optimizer, sampler)      # under `shoal run`: the launcher keeps the store
    for batch in live.batches(loader):
        with live.step():
            loss_fn(live.model(x), y).backward()      # live.model: DDP over this generation's group
    # each step is applied (optimizer.step, sampler.commit) on every member, or on none

Each step ends with one decision, kept in the job's store: every member whose gradients were all
averaged marks the step; the member that completes the count proposes "commit", and a member whose
step failed, or that finds a member lost before the count is complete, proposes "discard". The first
proposal stored wins, so members never disagree about a step. A discarded step is taken again, after
the members still alive have agreed on the next generation (membership.py): DDP adopts its group and
the sampler shares the lost members' samples out, so every sample is trained exactly once.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from shoal.backoff import attempts
from shoal.comm.store import Store
from shoal.data.elastic import ElasticSampler
from shoal.elastic.membership import Membership
from shoal.errors import GroupBrokenError, PeerFailure
from shoal.parallel import DistributedDataParallel

_LOSSES = (PeerFailure, GroupBrokenError)  # what ends a generation; anything else is the script's error


class LiveTraining:
    """One worker's part in a job with live recovery; `model` is the DDP replica to train."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, sampler: ElasticSampler, *,
                 timeout: timedelta = timedelta(seconds=60), **ddp_options: Any) -> None:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            raise RuntimeError("live recovery needs a store that outlives every worker: run the script under "
                               "`shoal run`, whose launcher serves it")
        host = os.environ["MASTER_ADDR"]
        store = Store.connect(host, int(os.environ["MASTER_PORT"]), world_size=int(os.environ["WORLD_SIZE"]),
                              is_server=False, timeout=timeout)
        self._store = store.scoped("live/")
        self.membership = Membership(self._store.scoped("generations/"), f"{socket.gethostname()}:{os.getpid()}",
                                     host=host, timeout=timeout)
        self.generation = self.membership.first(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        self.group = self.membership.group(self.generation)
        self.model = DistributedDataParallel(module, process_group=self.group, **ddp_options)
        self.optimizer, self.sampler = optimizer, sampler
        sampler.set_membership(self.group.rank, self.group.size)
        self.steps = 0
        """Steps committed: what a learning-rate schedule should follow."""
        self._timeout = timeout
        self._regrouped = False

    def batches(self, loader: Iterable) -> Iterator[Any]:
        """The loader's batches to the end of the epoch; after a change of generation, from the
        committed offset on, with the new members' shares."""
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
        except _LOSSES:
            reduced = False
        else:
            reduced = True
        if self._decide(reduced):
            self.optimizer.step()
            self.sampler.commit()
            self.steps += 1
        else:
            self._regroup()
        self.optimizer.zero_grad()

    def _decide(self, reduced: bool) -> bool:
        """Whether step `self.steps` of this generation commits, as every member will hear."""
        key = f"{self.generation.number}/steps/{self.steps}"
        if reduced and self._store.add(f"{key}/reduced", 1) == self.generation.size:
            return self._store.compare_set(key, "commit") == "commit"
        deadline = time.monotonic() + self._timeout.total_seconds()
        for _ in attempts(deadline, first=0.0002, limit=0.05, factor=2.0):
            if self._store.has(key):
                return self._store.get(key, timeout=self._timeout) == "commit"
            if not reduced or any(self.group.transport.failure(r) is not None for r in range(self.group.size)):
                if self._store.add(f"{key}/reduced", 0) < self.generation.size:
                    return self._store.compare_set(key, "discard") == "commit"
        raise TimeoutError(f"step {self.steps} of generation {self.generation.number}: no decision within "
                           f"{self._timeout.total_seconds():g}s")

    def _regroup(self) -> None:
        self.generation = self.membership.next(self.generation, self.group)
        self.group = self.membership.group(self.generation)
        self.model.adopt(self.group)
        self.sampler.set_membership(self.group.rank, self.group.size)
        self._regrouped = True

    def close(self) -> None:
        self.group.shutdown()
