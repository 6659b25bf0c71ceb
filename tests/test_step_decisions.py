"""The per-step decision of live recovery: every member hears the same answer, whoever fails when."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as tdist

from shoal.comm.store import Store
from shoal.elastic.decisions import COMMIT, DISCARD, GROW, StepDecisions
from tests.waiting import wait_until


def _none() -> bool:
    return False


def _decisions(timeout: float = 10, store: Store | None = None) -> StepDecisions:
    return StepDecisions(store or Store(tdist.HashStore()), timedelta(seconds=timeout))


def test_a_step_every_member_reduced_commits_even_if_the_last_to_mark_dies_before_proposing() -> None:
    store, lost = Store(tdist.HashStore()), threading.Event()
    decisions = _decisions(store=store)
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(decisions.decide, "0/7", 3, reduced=True, member_lost=lost.is_set,
                               joiners_waiting=_none) for _ in range(2)]
        wait_until(lambda: store.add("0/7/reduced", 0) >= 2, "both survivors have marked step 0/7 reduced",
                   timeout=10, interval=0.001)
        store.add("0/7/reduced", 1)  # the third marks, then dies before proposing
        lost.set()
        assert [w.result(timeout=10) for w in waiting] == [COMMIT, COMMIT]


def test_a_member_whose_step_failed_makes_everyone_discard() -> None:
    decisions = _decisions()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(decisions.decide, "0/0", 2, reduced=True, member_lost=_none, joiners_waiting=_none)
        assert decisions.decide("0/0", 2, reduced=False, member_lost=_none, joiners_waiting=_none) == DISCARD
        assert waiting.result(timeout=10) == DISCARD


def test_a_member_lost_before_it_marked_makes_everyone_discard() -> None:
    decisions, lost = _decisions(), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(decisions.decide, "1/3", 3, reduced=True, member_lost=lost.is_set, joiners_waiting=_none)
        lost.set()
        assert decisions.decide("1/3", 3, reduced=True, member_lost=lost.is_set, joiners_waiting=_none) == DISCARD
        assert waiting.result(timeout=10) == DISCARD


def test_no_decision_and_no_loss_times_out() -> None:
    with pytest.raises(TimeoutError, match=r"no decision within 0\.2s"):
        _decisions(timeout=0.2).decide("0/0", 2, reduced=True, member_lost=_none, joiners_waiting=_none)


def test_the_member_that_completes_the_count_admits_waiting_joiners_after_the_step() -> None:
    store = Store(tdist.HashStore())
    decisions = _decisions(store=store)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(decisions.decide, "2/5", 2, reduced=True, member_lost=_none, joiners_waiting=_none)
        wait_until(lambda: store.add("2/5/reduced", 0) >= 1, "the other member has marked step 2/5 reduced",
                   timeout=10, interval=0.001)
        assert decisions.decide("2/5", 2, reduced=True, member_lost=_none, joiners_waiting=lambda: True) == GROW
        assert waiting.result(timeout=10) == GROW


def test_joiners_never_turn_a_discarded_step_into_a_commit() -> None:
    decisions = _decisions()
    assert decisions.decide("0/1", 2, reduced=False, member_lost=_none, joiners_waiting=lambda: True) == DISCARD
