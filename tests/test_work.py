"""Work handles without a group: done-callbacks (a raising one harms neither the others nor the finisher),
AllOf (several operations as one), and torch's Work over shoal's (then, futures, errors)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist

from shoal.comm.as_torch.work import TorchWork
from shoal.comm.backends.work import AllOf, Work
from shoal.errors import PeerFailure

_TIMEOUT = timedelta(seconds=10)


def test_done_callbacks_run_once_each_even_when_one_raises() -> None:
    work, seen = Work("op", _TIMEOUT), []

    def bad(error: BaseException | None) -> None:
        raise RuntimeError("a callback's own bug")

    work.add_done_callback(bad)
    work.add_done_callback(seen.append)
    work.finish()  # does not raise
    work.finish(PeerFailure(1))  # the first outcome wins
    work.add_done_callback(seen.append)  # already done: called at once
    assert seen == [None, None] and work.wait()


def test_all_of_finishes_with_the_last_part_and_fails_with_the_first_error() -> None:
    parts = [Work(f"part {i}", _TIMEOUT) for i in range(3)]
    whole = AllOf("whole", parts, _TIMEOUT)
    parts[1].finish(PeerFailure(2, "gone"))
    parts[0].finish()
    assert not whole.is_completed()
    parts[2].finish(PeerFailure(3))
    with pytest.raises(PeerFailure, match="rank 2 failed: gone"):
        whole.wait()
    assert AllOf("nothing", [], _TIMEOUT).wait()


def test_torch_work_runs_then_before_it_counts_as_done_and_settles_futures() -> None:
    work, tensor = Work("op", _TIMEOUT), torch.ones(2)
    ran_then = threading.Event()
    torch_work = TorchWork(work, [tensor], then=lambda: (tensor.mul_(3), ran_then.set()))
    early = torch_work.get_future()
    assert not torch_work.is_completed()
    work.finish()
    assert ran_then.is_set() and torch_work.wait() and torch_work.is_success()
    assert torch.equal(early.wait()[0], torch.full((2,), 3.0))
    assert torch.equal(torch_work.get_future().wait()[0], torch.full((2,), 3.0))  # a future asked for later


def test_torch_work_raises_dist_backend_error_naming_the_rank() -> None:
    work = Work("op", _TIMEOUT)
    torch_work = TorchWork(work, [])
    future = torch_work.get_future()
    work.finish(PeerFailure(1, "connection reset"))
    with pytest.raises(tdist.DistBackendError, match="rank 1 failed: connection reset") as caught:
        torch_work.wait()
    assert isinstance(caught.value.__cause__, PeerFailure)
    assert isinstance(torch_work.exception(), tdist.DistBackendError) and not torch_work.is_success()
    with pytest.raises(tdist.DistBackendError, match="rank 1 failed"):
        future.wait()


def test_a_future_s_callback_runs_off_the_finishing_thread_and_may_wait_for_a_later_op() -> None:
    """The thread that finishes an op (a group's queue) is free for the next while the callback waits."""
    first, second = Work("first", _TIMEOUT), Work("second", _TIMEOUT)
    later = TorchWork(second, [torch.ones(1)])
    callback_threads = []

    def wait_for_the_second(future: torch.futures.Future) -> torch.Tensor:
        callback_threads.append(threading.current_thread())
        return future.value()[0] + later.get_future().wait()[0]

    earlier = TorchWork(first, [torch.ones(1)])
    chained = earlier.get_future().then(wait_for_the_second)
    finisher = threading.Thread(target=first.finish)
    finisher.start()
    finisher.join(10)
    assert not finisher.is_alive()  # it returned though the callback waits for `second`
    assert not earlier.is_completed()  # done, as gloo's Work, once its futures' callbacks have run
    second.finish()
    assert chained.wait().item() == 2.0 and earlier.wait() and earlier.is_completed()
    assert callback_threads and callback_threads[0] not in (threading.current_thread(), finisher)


def test_a_resolver_job_waiting_for_a_later_one_never_holds_it_up() -> None:
    from shoal.comm.as_torch.resolvers import Resolvers

    resolvers, done = Resolvers(), [threading.Event() for _ in range(4)]
    for i in range(3):  # each job waits for the next: four at once, on four threads
        resolvers.run(lambda i=i: done[i + 1].wait(10) and done[i].set())
    resolvers.run(done[3].set)
    assert done[0].wait(10)
    again = threading.Event()
    resolvers.run(again.set)  # served by an idle thread or a new one alike
    assert again.wait(10)
