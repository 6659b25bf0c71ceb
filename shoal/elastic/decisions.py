"""The decision on each step of a job with live recovery, kept in the job's store: the step is applied
on every member or on none.

Every member whose gradients were all averaged marks the step. "commit" needs every member's mark:
the member that completes the count proposes it, and so does a member that finds a member lost once
the count is complete (the one that completed it may have died before proposing). "discard" is
proposed by a member whose step failed, or that finds a member lost before the count is complete.
A member proposing commit proposes "grow" instead when it finds workers waiting to join (it looks at
most every so often): the step commits, then the members admit them. The first proposal stored wins
(compare-and-set), so members never disagree.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

from shoal.backoff import attempts
from shoal.comm.store import Store

COMMIT, GROW, DISCARD = "commit", "grow", "discard"


class StepDecisions:
    def __init__(self, store: Store, timeout: timedelta) -> None:
        self._store = store
        self._timeout = timeout

    def decide(self, step: str, size: int, *, reduced: bool, member_lost: Callable[[], bool],
               joiners_waiting: Callable[[], bool]) -> str:
        """COMMIT, GROW or DISCARD for `step` (a key unique to it), as all `size` members will hear.
        `reduced`: this member's gradients were all averaged; `member_lost`: whether a member is known
        lost now; `joiners_waiting`: whether workers wait to join."""
        if reduced and self._store.add(f"{step}/reduced", 1) == size:
            return self._store.compare_set(step, GROW if joiners_waiting() else COMMIT)
        deadline = time.monotonic() + self._timeout.total_seconds()
        for _ in attempts(deadline, first=0.0002, limit=0.02, factor=1.5):
            if self._store.has(step):
                return self._store.get(step, timeout=self._timeout)
            if not reduced or member_lost():
                complete = self._store.add(f"{step}/reduced", 0) == size
                return self._store.compare_set(step, (GROW if joiners_waiting() else COMMIT) if complete else DISCARD)
        raise TimeoutError(f"{step}: no decision within {self._timeout.total_seconds():g}s")

    def discard(self, step: str) -> None:
        """Propose that `step` be discarded (this member leaves it with an error of its own)."""
        self._store.compare_set(step, DISCARD)
