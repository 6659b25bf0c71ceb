"""The workers of an RPC group by rank and name: those it started with, and those that joined it
since. A worker that joins registers in the group's store; the others look it up there the first
time they meet its name or rank.

The group's keys in the store, besides those of starting (members/R, ready/R, ...):
- `joiners`: how many workers have begun to join; `joiner/N` the rank of the N-th;
- `drawn`: the ranks drawn for joiners that did not ask for one; `claims/R` the claims on rank R;
- `name-claims/NAME`: the rank that claimed a joiner's NAME (null once a failed join freed it);
  `names/NAME` that rank, set once the joiner is connected to every member.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from shoal.rpc import current
from shoal.rpc.options import WorkerInfo

_LOOKUP_TIMEOUT = timedelta(seconds=5)  # a key that `has` saw is read at once


class Members:
    """This worker's table of the group's workers (`workers` to start with), kept up from `store`."""

    def __init__(self, workers: list[WorkerInfo], store: Any, world_size: int) -> None:
        self._store, self._world_size = store, world_size
        self._lock = threading.Lock()
        self._by_rank = {worker.id: worker for worker in workers}
        self._by_name = {worker.name: worker for worker in workers}

    def named(self, name: str) -> WorkerInfo | None:
        """The worker called `name`, if one has joined by that name."""
        with self._lock:
            known = self._by_name.get(name)
        if known is None and self._store.has(f"names/{name}"):
            known = self.learn(name, self._store.get(f"names/{name}", timeout=_LOOKUP_TIMEOUT))
        return known

    def ranked(self, rank: int) -> WorkerInfo | None:
        """The worker of `rank`, if one has joined with that rank."""
        with self._lock:
            known = self._by_rank.get(rank)
        if known is None and rank >= self._world_size and self._store.has(f"ready/{rank}"):
            known = self.learn(self._store.get(f"members/{rank}", timeout=_LOOKUP_TIMEOUT)[0], rank)
        return known

    def info(self, rank: int) -> WorkerInfo:
        """The worker of `rank`, also one that began to join and never finished: to name it in errors,
        so a store that cannot be read (its server gone) leaves it named by its rank."""
        with self._lock:
            known = self._by_rank.get(rank)
        try:
            if known is None and self._store.has(f"members/{rank}"):
                known = WorkerInfo(self._store.get(f"members/{rank}", timeout=_LOOKUP_TIMEOUT)[0], rank)
        except Exception:  # only a name is at stake
            pass
        return known or WorkerInfo(f"rank {rank}", rank)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def ranks(self) -> list[int]:
        """Every rank that started the group or has finished joining it, by the store."""
        joined = [self._store.get(f"joiner/{n}", timeout=_LOOKUP_TIMEOUT) for n in range(self._store.add("joiners", 0))
                  if self._store.has(f"joiner/{n}")]
        return [*range(self._world_size), *sorted(r for r in joined if self._store.has(f"ready/{r}"))]

    def learn(self, name: str, rank: int) -> WorkerInfo:
        worker = WorkerInfo(name, rank)
        with self._lock:
            self._by_rank[rank], self._by_name[name] = worker, worker
        return worker


def welcome(name: str, rank: int) -> None:
    """Runs on a member, sent by a worker that has just joined: its name is known here before anything
    needs it (such as naming it, on a connection's thread, when it dies)."""
    current.current_agent().members.learn(name, rank)
