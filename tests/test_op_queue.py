"""A group's operation queue: jobs run one at a time in the order they came; a blocking call that
finds the queue idle runs on its caller's thread, and that costs the queue's own thread nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from shoal.comm.backends.work import OpQueue
from tests.threads import linux_only, named, voluntary_switches
from tests.waiting import wait_until

TIMEOUT_S = 10


def _nothing() -> None:
    pass


@contextmanager
def _started(queue_name: str) -> Iterator[tuple[OpQueue, threading.Thread]]:
    """A queue whose own thread exists (it ran a queued job) and has gone idle; closed afterwards."""
    queue = OpQueue(queue_name)
    try:
        assert not queue.submit(_nothing)  # queued: this starts the thread
        # Each try that finds the thread busy queues one more job behind what still runs.
        wait_until(lambda: queue.submit(_nothing, inline_if_idle=True), "the queue's thread goes idle",
                   timeout=TIMEOUT_S, interval=0.001)
        queue.run_here(_nothing)  # the queue was idle: no job of the thread's is left
        yield queue, named(queue_name)
    finally:
        queue.close(timedelta(seconds=TIMEOUT_S))


def test_queued_jobs_run_one_at_a_time_in_order_and_an_inline_call_waits_its_turn() -> None:
    gate, ran = threading.Event(), []
    with _started("test-queue-order") as (queue, _):
        assert not queue.submit(lambda: (gate.wait(TIMEOUT_S), ran.append("first")))
        assert not queue.submit(lambda: ran.append("second"))
        assert not queue.submit(lambda: ran.append("third"), inline_if_idle=True)  # busy: queued, not run here
        gate.set()
    assert ran == ["first", "second", "third"]  # closing waited for all three


def test_a_blocking_call_on_an_idle_queue_runs_on_the_callers_thread() -> None:
    ran_on = []

    def job() -> None:
        ran_on.append(threading.current_thread())

    with _started("test-queue-inline") as (queue, _):
        assert queue.submit(job, inline_if_idle=True)
        queue.run_here(job)
    assert ran_on == [threading.current_thread()]


@linux_only
def test_inline_calls_leave_the_queues_idle_thread_asleep() -> None:
    # Each wake-up of an idle thread costs a context switch and the GIL, on a machine whose cores the
    # ranks share; before, every inline call's end woke the queue's thread, which found nothing to do.
    def collective() -> None:
        time.sleep(0.001)  # it blocks, as a collective does, letting others run

    with _started("test-queue-asleep") as (queue, thread):
        before = voluntary_switches(thread)
        for _ in range(200):
            assert queue.submit(collective, inline_if_idle=True)
            queue.run_here(collective)
        assert voluntary_switches(thread) - before < 20
    thread.join(TIMEOUT_S)
    assert not thread.is_alive()
