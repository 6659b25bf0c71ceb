"""The tests' own helpers: run_ranks names a failing rank with its traceback, does not wait for a rank
killed on purpose, keeps its deadline, and leaves no process behind (the conftest guard checks that
after each test); run_rpc_ranks names its workers; wait_until says what never happened."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from shoal import rpc
from tests.ranks import RankFailed, run_ranks, run_rpc_ranks
from tests.waiting import process_gone, wait_until

_forever = threading.Event()  # never set: a rank that waits on it runs until it is killed


def _one_fails(rank: int, world: int, port: int, how: str) -> int:
    if rank == 1:
        if how == "raises":
            raise ValueError(f"rank {rank} gave up")
        if how == "misses a pytest.raises":
            with pytest.raises(KeyError):
                pass
        os.kill(os.getpid(), signal.SIGKILL)
    _forever.wait(600)  # stopped by run_ranks once rank 1 has failed
    return rank


def test_a_rank_that_raises_fails_the_run_at_once_with_its_rank_and_traceback() -> None:
    started = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        run_ranks(_one_fails, 2, "raises", backend=None, timeout=60)
    message = str(failed.value)
    assert message.startswith("rank 1 (pid ") and "failed: ValueError: rank 1 gave up" in message, message
    assert "in _one_fails" in message  # the traceback
    assert time.monotonic() - started < 40  # not at the deadline: rank 0 still waited when rank 1 failed


def test_a_pytest_outcome_in_a_rank_is_reported_as_a_failure_too() -> None:
    with pytest.raises(RankFailed, match=r"rank 1 \(pid \d+\) failed: RuntimeError: Failed: DID NOT RAISE"):
        run_ranks(_one_fails, 2, "misses a pytest.raises", backend=None, timeout=60)


def test_a_rank_killed_unexpectedly_fails_the_run() -> None:
    with pytest.raises(RankFailed, match=r"rank 1 \(pid \d+\) was killed by SIGKILL without returning a result"):
        run_ranks(_one_fails, 2, "dies", backend=None, timeout=60)


def _rank_1_dies(rank: int, world: int, port: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank * 10


def test_a_rank_killed_on_purpose_is_not_waited_for() -> None:
    assert run_ranks(_rank_1_dies, 3, backend=None, timeout=60, expect={1: "dies"}) == {0: 0, 2: 20}


def _rank_1_hangs(rank: int, world: int, port: int) -> int:
    if rank == 1:
        _forever.wait(600)
    return os.getpid()


def test_ranks_that_do_not_return_in_time_are_named_and_killed() -> None:
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish within 20s"):
        run_ranks(_rank_1_hangs, 2, backend=None, timeout=20)


def test_a_ranks_expectation_other_than_dying_is_refused() -> None:
    with pytest.raises(ValueError, match=r"expect maps ranks to 'dies' \(killed on purpose\), got \{1: 'fails'\}"):
        run_ranks(_rank_1_dies, 2, backend=None, expect={1: "fails"})


def greeting(to: str) -> str:
    return f"{to}, from {rpc.get_worker_info().name}"


def _greet(rank: int, world: int, to: str) -> tuple[str, str]:
    return rpc.get_worker_info().name, rpc.rpc_sync((rank + 1) % world, greeting, args=(f"{to} {rank}",))


def test_rpc_ranks_are_workers_of_one_group_under_the_names_given() -> None:
    out = run_rpc_ranks(_greet, 2, "hello", names=["trainer", "server"], timeout=60)
    assert out == {0: ("trainer", "hello 0, from server"), 1: ("server", "hello 1, from trainer")}


def test_wait_until_returns_what_the_condition_returned() -> None:
    calls = []

    def third_call() -> str | None:
        calls.append(1)
        return "done" if len(calls) == 3 else None

    assert wait_until(third_call, "the condition is called a third time", timeout=5) == "done"
    assert len(calls) == 3


def test_wait_until_names_what_never_happened_and_its_timeout() -> None:
    with pytest.raises(TimeoutError, match=r"timed out after 0\.1 s waiting until the moon is blue"):
        wait_until(lambda: False, "the moon is blue", timeout=0.1)


def test_wait_until_ends_with_the_conditions_own_exception() -> None:
    def a_child_ended() -> bool:
        raise AssertionError("a child ended while we waited")

    with pytest.raises(AssertionError, match="a child ended while we waited"):
        wait_until(a_child_ended, "never", timeout=5)


def test_a_process_that_has_exited_is_gone_before_it_is_reaped() -> None:
    assert not process_gone(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        wait_until(lambda: process_gone(child.pid), f"child {child.pid} has exited", timeout=10)
        assert child.returncode is None  # not yet reaped: a zombie counts as gone
    finally:
        child.wait(10)
