"""The per-step decision of live recovery: every member hears the same answer, whoever fails when."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as tdist

from shoal.comm.store import Store
from shoal.elastic.decisions import StepDecisions


def _decisions(timeout: float = 10, store: Store | None = None) -> StepDecisions:
    return StepDecisions(store or Store(tdist.HashStore()), timedelta(seconds=timeout))


def test_a_step_every_member_reduced_commits_even_if_the_last_to_mark_dies_before_proposing() -> None:
    store, lost = Store(tdist.HashStore()), threading.Event()
    decisions = _decisions(store=store)
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(decisions.decide, "0/7", 3, reduced=True, member_lost=lost.is_set) for _ in range(2)]
        deadline = time.monotonic() + 10
        while store.add("0/7/reduced", 0) < 2 and time.monotonic() < deadline:  # both survivors have marked
            time.sleep(0.001)
        store.add("0/7/reduced", 1)  # the third marks, then dies before proposing
        lost.set()
        assert [w.result(timeout=10) for w in waiting] == [True, True]


def test_a_member_whose_step_failed_makes_everyone_discard() -> None:
    decisions = _decisions()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(decisions.decide, "0/0", 2, reduced=True, member_lost=lambda: False)
        assert decisions.decide("0/0", 2, reduced=False, member_lost=lambda: False) is False
        assert waiting.result(timeout=10) is False


def test_a_member_lost_before_it_marked_makes_everyone_discard() -> None:
    decisions, lost = _decisions(), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(decisions.decide, "1/3", 3, reduced=True, member_lost=lost.is_set)
        lost.set()
        assert decisions.decide("1/3", 3, reduced=True, member_lost=lost.is_set) is False
        assert waiting.result(timeout=10) is False


def test_no_decision_and_no_loss_times_out() -> None:
    with pytest.raises(TimeoutError, match=r"no decision within 0\.2s"):
        _decisions(timeout=0.2).decide("0/0", 2, reduced=True, member_lost=lambda: False)
