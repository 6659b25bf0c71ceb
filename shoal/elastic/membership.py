"""Generations of a job's membership, agreed through the job's store, which outlives every worker (the
launcher serves it).

A generation is a number and its members' ids in rank order. Process groups are built per generation
(`Membership.group`), so a failure ends a generation, not the job: DDP adopts each generation's group.
When members are lost, or workers ask to join, the members agree on the next generation: each registers
under it and waits until every member of the current one has either registered or is known lost to the
current group (`ProcessGroup.failed_ranks`: crashed, left, or silent past the heartbeat timeout); then it
proposes those registered, followed by the joiners waiting.
The first proposal stored wins (compare-and-set), so no two members ever see different members for one
generation, whatever the partition, and a member left out learns so (EvictedError).

A worker joins by taking the next numbered join slot, and beats there while it waits; members look for
one at step boundaries (`joiners_waiting`), admit only joiners they see beating (one killed while it
waited is passed over, and one merely slow asks again), and tell each joiner which generation admitted it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from datetime import timedelta

from shoal.backoff import attempts
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.backends.registry import check_backend, world_group
from shoal.comm.store import Store

JOIN_WAIT = timedelta(minutes=10)  # how long a joiner waits to be admitted: between steps may be long (evaluation)
_JOINER_SILENT_S = 5.0  # a joiner that has not beaten for this long is passed over (it beats every 0.1 s)
_WITHDRAWN = "withdrawn"  # the joiner gave up waiting
_PASSED_OVER = "passed over"  # the members saw it silent: if it still lives, it asks again


class EvictedError(RuntimeError):
    """This worker is not a member of the generation the others agreed on (they judged it lost)."""


class JobFinished(SystemExit):
    """The job ended before this worker could join it: it ends the process with status 0 unless caught."""

    def __init__(self) -> None:
        super().__init__(0)


@dataclass(frozen=True)
class Generation:
    number: int
    members: tuple[str, ...]
    """Member ids, in rank order."""
    joined: int = 0
    """How many join slots generations up to this one have admitted (slots are numbered from 1)."""

    @property
    def size(self) -> int:
        return len(self.members)

    def rank(self, member: str) -> int:
        return self.members.index(member)


class Membership:
    """One worker's part in the job's generations: it is `me` (an id unique in the job) in all of them.
    Each generation's group is of `backend`; "shoal" finds lost members itself, where torch's engines
    (which find none: see `ProcessGroup.failed_ranks`) hold up the next generation until the timeout."""

    def __init__(self, store: Store, me: str, *, host: str, timeout: timedelta, backend: str = "shoal") -> None:
        self._store = store
        self.me = me
        self._host = host  # the store's host, toward which ranks listen (rendezvous.listen_addresses)
        self._timeout = timeout
        self.backend = check_backend(backend)

    def first(self, rank: int, world_size: int) -> Generation | None:
        """Generation 0: the workers the launcher started, in the order of their launch ranks; None if
        `rank`'s place in it is taken (this worker was started in place of a lost one: it must `join`)."""
        if self._store.compare_set(f"0/member/{rank}", self.me) != self.me:
            return None
        members = tuple(self._store.get(f"0/member/{r}", timeout=self._timeout) for r in range(world_size))
        if len(set(members)) != world_size:
            raise ValueError(f"generation 0: member ids {members} are not unique")
        return Generation(0, members)

    def join(self) -> Generation:
        """Ask to join, and wait until a generation admits this worker (the members look at their next
        step boundary); JobFinished if the job ends first. After `JOIN_WAIT` (or the timeout, if
        longer) the request is withdrawn and TimeoutError raised."""
        patience = max(self._timeout, JOIN_WAIT).total_seconds()
        deadline, slot = time.monotonic() + patience, 0
        while time.monotonic() < deadline:
            slot = next(k for k in itertools.count(slot + 1)
                        if self._store.compare_set(f"joins/{k}", self.me) == self.me)
            for _ in attempts(deadline, first=0.005, limit=0.1, factor=1.5):
                self._store.add(f"joins/{slot}/beats", 1)
                if self._store.has(f"joins/{slot}/generation"):
                    break
                if self._store.has("finished"):
                    raise JobFinished
            outcome = self._store.compare_set(f"joins/{slot}/generation", _WITHDRAWN)
            if outcome not in (_WITHDRAWN, _PASSED_OVER):
                return self._agreed(int(outcome))
            if outcome == _WITHDRAWN:
                break
        raise TimeoutError(f"{self.me}: no generation admitted this worker within {patience:g}s (the members "
                           f"admit joiners between steps); its request is withdrawn")

    def joiners_waiting(self, generation: Generation) -> bool:
        """Whether a worker has asked to join since `generation` was agreed."""
        return self._store.has(f"joins/{generation.joined + 1}")

    def finish(self, last: Generation) -> None:
        """The generations end with `last`: workers still waiting to join learn so (JobFinished)."""
        self._store.compare_set("finished", list(last.members))

    def last_members(self) -> tuple[str, ...]:
        """The members of the last generation, once `finish` has been called (waits up to the timeout)."""
        return tuple(self._store.get("finished", timeout=self._timeout))

    def group(self, generation: Generation) -> ProcessGroup:
        """The world group of `generation`, connected anew (its store keys are the generation's own)."""
        return world_group(self.backend, self._store.scoped(f"{generation.number}/group/"), generation.rank(self.me),
                           generation.size, self._timeout, self._host)

    def next(self, current: Generation, group: ProcessGroup) -> Generation:
        """The generation after `current`, agreed with the other members still alive. `group` is
        `current`'s: it tells which members are lost; it is shut down once they agree. Joiners waiting
        come after the members, so rank 0 is a member of `current`."""
        number = current.number + 1
        self._store.set(f"{number}/alive/{self.me}", 1)
        deadline = time.monotonic() + self._timeout.total_seconds()
        for _ in attempts(deadline, first=0.005, limit=0.1, factor=1.5):
            registered = [m for m in current.members if self._store.has(f"{number}/alive/{m}")]
            lost = group.failed_ranks()
            undecided = [m for m in current.members if m not in registered and current.rank(m) not in lost]
            if not undecided:
                break
        else:
            group.shutdown()
            raise TimeoutError(f"generation {number}: members {undecided} neither joined it nor were found lost "
                               f"within {self._timeout.total_seconds():g}s")
        slots = list(itertools.takewhile(lambda k: self._store.has(f"joins/{k}"), itertools.count(current.joined + 1)))
        joiners = [self._store.get(f"joins/{k}", timeout=self._timeout) for k in self._beating(slots)]
        survivors = [m for m in current.members if m in registered]
        self._store.compare_set(f"{number}/members", {"members": survivors + joiners,
                                                     "joined": current.joined + len(slots)})
        generation = self._agreed(number)
        for slot in range(current.joined + 1, generation.joined + 1):
            admitted = self._store.get(f"joins/{slot}") in generation.members
            self._store.compare_set(f"joins/{slot}/generation", number if admitted else _PASSED_OVER)
        group.shutdown()
        if self.me not in generation.members:
            raise EvictedError(f"{self.me}: generation {number} was agreed without this worker "
                               f"(members {list(generation.members)})")
        return generation

    def _beating(self, slots: list[int]) -> list[int]:
        """Of the join `slots`, those whose joiner still waits: not withdrawn, and beating (seen within
        `_JOINER_SILENT_S`); a joiner killed while it waited never beats again."""
        waiting = {k: self._store.add(f"joins/{k}/beats", 0) for k in slots
                   if not self._store.has(f"joins/{k}/generation")}
        beating: set[int] = set()
        for _ in attempts(time.monotonic() + _JOINER_SILENT_S, first=0.005, limit=0.05, factor=1.5):
            beating |= {k for k, beats in waiting.items()
                        if k not in beating and self._store.add(f"joins/{k}/beats", 0) != beats}
            if len(beating) == len(waiting):
                break
        return sorted(beating)

    def _agreed(self, number: int) -> Generation:
        record = self._store.get(f"{number}/members", timeout=self._timeout)
        return Generation(number, tuple(record["members"]), record["joined"])
