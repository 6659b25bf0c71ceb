"""A group's operation queue: jobs run one at a time in the order they came; a blocking call that
finds the queue idle runs on its caller's thread, and that costs the queue's own thread nothing."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from shoal.comm.work import OpQueue
from tests.threads import linux_only, named, voluntary_switches

WAIT_S = 10


def _started(queue_name: str) -> tuple[OpQueue, threading.Thread]:
    """A queue whose own thread exists (it ran a queued job) and has gone idle."""
    queue = OpQueue(queue_name)
    assert not queue.submit(int)  # queued: this starts the thread
    while not queue.submit(int, inline_if_idle=True):  # queued too, behind what still runs
        time.sleep(0.001)
    queue.run_here(int)  # the queue was idle: no job of the thread's is left
    return queue, named(queue_name)


def test_queued_jobs_run_one_at_a_time_in_order_and_an_inline_call_waits_its_turn() -> None:
    queue, _ = _started("test-queue-order")
    gate, ran = threading.Event(), []
    assert not queue.submit(lambda: (gate.wait(WAIT_S), ran.append("first")))
    assert not queue.submit(lambda: ran.append("second"))
    assert not queue.submit(lambda: ran.append("third"), inline_if_idle=True)  # busy: queued, not run here
    gate.set()
    queue.close(timedelta(seconds=WAIT_S))
    assert ran == ["first", "second", "third"]


def test_a_blocking_call_on_an_idle_queue_runs_on_the_callers_thread() -> None:
    queue, _ = _started("test-queue-inline")
    ran_on = []
    job = lambda: ran_on.append(threading.current_thread())  # noqa: E731
    assert queue.submit(job, inline_if_idle=True)
    queue.run_here(job)
    assert ran_on == [threading.current_thread()]
    queue.close(timedelta(seconds=WAIT_S))


@linux_only
def test_inline_calls_leave_the_queues_idle_thread_asleep() -> None:
    # Each wake-up of an idle thread costs a context switch and the GIL, on a machine whose cores the
    # ranks share; before, every inline call's end woke the queue's thread, which found nothing to do.
    queue, thread = _started("test-queue-asleep")
    collective = lambda: time.sleep(0.001)  # noqa: E731  (it blocks, as a collective does, letting others run)
    before = voluntary_switches(thread)
    for _ in range(200):
        assert queue.submit(collective, inline_if_idle=True)
        queue.run_here(collective)
    assert voluntary_switches(thread) - before < 20
    queue.close(timedelta(seconds=WAIT_S))
    thread.join(WAIT_S)
    assert not thread.is_alive()
