"""shoal.multiprocessing: spawn's handling of failing children, and tensors shared with children through memory."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
from torch import nn

import shoal.multiprocessing as mp
from tests.waiting import process_gone, wait_until

ROOT = Path(__file__).resolve().parents[1]
_DEADLINE_S = 60.0
_SPAWN = mp.get_context("spawn")


def _join(context: mp.ProcessContext) -> None:
    # join itself waits (a second at a time), so the poll needs no pause of its own.
    wait_until(lambda: context.join(timeout=1.0), f"children {context.pids()} have exited", timeout=_DEADLINE_S,
               interval=0)


@pytest.fixture
def contexts() -> Iterator[list[mp.ProcessContext]]:
    """The tests' process contexts: whatever is still running at the end is killed."""
    started: list[mp.ProcessContext] = []
    yield started
    for context in started:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(5)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --- spawn ---

def _one_raises(index: int) -> None:
    if index == 1:
        raise ValueError(f"child {index} gave up")
    time.sleep(600)


def test_a_child_exception_reaches_the_parent_with_its_traceback_and_stops_the_others(contexts) -> None:
    context = mp.spawn(_one_raises, nprocs=3, join=False)
    contexts.append(context)
    with pytest.raises(mp.ProcessRaisedException) as raised:
        _join(context)
    assert raised.value.error_index == 1 and raised.value.pid == context.pids()[1]
    assert "ValueError: child 1 gave up" in str(raised.value) and "in _one_raises" in str(raised.value)
    assert [p.exitcode for p in context.processes] == [-signal.SIGTERM, 1, -signal.SIGTERM]


def _exits(index: int, code: int) -> None:
    if index == 0:
        sys.exit(code)


def _killed(index: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _fine(index: int, out: mp.Queue) -> None:
    out.put(index)


def test_exits_without_an_exception_are_named_with_their_code_or_signal() -> None:
    with pytest.raises(mp.ProcessExitedException, match=r"process 0 .* exited with code 3") as exited:
        mp.spawn(_exits, args=(3,), nprocs=2)
    assert exited.value.exit_code == 3 and exited.value.signal_name is None
    with pytest.raises(mp.ProcessExitedException, match="killed by SIGKILL") as killed:
        mp.spawn(_killed, nprocs=1)
    assert killed.value.signal_name == "SIGKILL"


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_spawn_runs_every_index_and_returns_when_all_are_done(start_method: str) -> None:
    out = mp.get_context(start_method).SimpleQueue()
    assert mp.spawn(_fine, args=(out,), nprocs=3, start_method=start_method) is None
    assert sorted(out.get() for _ in range(3)) == [0, 1, 2]
    with pytest.raises(ValueError, match="nprocs must be at least 1, got 0"):
        mp.spawn(_fine, args=(out,), nprocs=0)


def test_children_die_with_their_parent() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", "import time, shoal.multiprocessing as mp\n"
         "from tests.test_multiprocessing import _one_raises\n"
         "context = mp.spawn(_one_raises, args=(), nprocs=1, join=False)\n"
         "print(*context.pids(), flush=True)\n"
         "time.sleep(600)\n"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        children = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(children) == 1
        parent.kill()
        parent.wait(10)
        for pid in children:
            wait_until(lambda pid=pid: process_gone(pid), f"child {pid} has died with its parent", timeout=10,
                       interval=0.1)
    finally:
        parent.kill()
        parent.wait(10)


# --- tensors in shared memory ---

def _write_then_check(index: int, tensors: list[torch.Tensor], child_wrote, parent_wrote) -> None:
    param = tensors[2]
    assert isinstance(param, nn.Parameter) and param.requires_grad
    with torch.no_grad():
        for tensor in tensors:
            tensor[0] = 1.0
    child_wrote.set()
    if not parent_wrote.wait(_DEADLINE_S):
        raise TimeoutError("the parent never wrote")
    seen = [tensor[1].item() for tensor in tensors]
    if seen != [2.0, 2.0, 2.0]:
        raise AssertionError(f"the child sees {seen}, not the parent's writes")


def test_writes_to_a_shared_tensor_are_seen_both_ways(contexts) -> None:
    plain = torch.zeros(4)
    view = plain[1:]  # taken before the tensor is shared: it must follow its storage into shared memory
    shared = torch.zeros(4).share_memory_()
    param = nn.Parameter(torch.zeros(3))
    child_wrote, parent_wrote = _SPAWN.Event(), _SPAWN.Event()
    context = mp.spawn(_write_then_check, args=([plain, shared, param], child_wrote, parent_wrote), join=False)
    contexts.append(context)
    assert child_wrote.wait(_DEADLINE_S)
    assert [plain[0].item(), shared[0].item(), param[0].item()] == [1.0, 1.0, 1.0]
    with torch.no_grad():
        view[0] = 2.0
        shared[1] = 2.0
        param[1] = 2.0
    parent_wrote.set()
    _join(context)


def _echo(index: int, inbox: mp.Queue, outbox) -> None:
    """Take a list of tensors; add one to the first in place, send doubled copies of all back."""
    tensors = inbox.get(timeout=_DEADLINE_S)
    whole, tail = tensors[0], tensors[1]
    assert tail.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()  # one storage still
    tail[0] = 7.0
    whole.add_(1)
    outbox.send([t * 2 if t.dtype != torch.bool else ~t for t in tensors])
    outbox.recv()  # stay alive until the parent has the reply: its memory is passed by descriptor


def test_tensors_through_a_queue_and_a_pipe_keep_values_dtypes_and_aliasing(contexts) -> None:
    inbox = _SPAWN.Queue()
    here, there = _SPAWN.Pipe()
    whole = torch.arange(6, dtype=torch.float64)
    tensors = [whole, whole[2:], torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),
               torch.tensor([True, False]), torch.randn(3).to(torch.bfloat16), torch.empty(0), torch.tensor(5.0)]
    expected = [t.clone() for t in tensors]
    context = mp.spawn(_echo, args=(inbox, there), join=False)
    contexts.append(context)
    inbox.put(tensors)
    assert here.poll(_DEADLINE_S)
    replies = here.recv()
    here.send(None)
    _join(context)
    expected[0][2] = 7.0
    expected[0] += 1
    expected[1] = expected[0][2:]
    assert torch.equal(whole, expected[0])  # the child's in-place writes, seen here
    for reply, want in zip(replies, expected, strict=True):
        assert reply.dtype == want.dtype and torch.equal(reply, want * 2 if want.dtype != torch.bool else ~want)


def test_a_storage_sent_from_two_threads_at_once_moves_to_shared_memory_once() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from shoal.multiprocessing.reductions import _descriptor

    for _ in range(20):
        storage = torch.zeros(1 << 20).untyped_storage()
        with ThreadPoolExecutor(2) as pool:
            assert len(set(pool.map(_descriptor, [storage, storage]))) == 1


def _memfds() -> set[tuple[str, str]]:
    """This process's open descriptors of anonymous memory files: (descriptor, file)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("/memfd:"):
                found.add((fd, target))
    return found


def test_a_failed_move_to_shared_memory_leaves_the_tensor_private_and_no_descriptor_open(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared memory short (the move's mapping fails), on the sender and on the receiver."""
    from shoal.multiprocessing import reductions

    def no_memory(fd: int, nbytes: int) -> torch.UntypedStorage:
        raise OSError(12, "Cannot allocate memory")

    tensor = torch.arange(1000.0)
    gc.collect()  # earlier tests' tensors let go of their memory files now, not while this test counts
    before = _memfds()
    monkeypatch.setattr(reductions, "_map", no_memory)
    with pytest.raises(OSError, match="Cannot allocate memory"):
        ForkingPickler.dumps(tensor)
    assert _memfds() <= before
    assert not tensor.is_shared() and torch.equal(tensor, torch.arange(1000.0))

    class Handle:  # what multiprocessing hands a receiver: a descriptor to detach
        def detach(self) -> int:
            return os.memfd_create("received")

    with pytest.raises(OSError, match="Cannot allocate memory"):
        reductions._rebuild_storage(Handle(), 4000)
    assert _memfds() <= before


def test_a_non_leaf_that_requires_grad_is_refused_by_name() -> None:
    with pytest.raises(RuntimeError, match="requires grad and is not a leaf"):
        ForkingPickler.dumps(torch.ones(2, requires_grad=True) * 2)


def _descriptors() -> set[tuple[int, int, int]]:
    """This process's open descriptors, each by number and the identity of what it refers to."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            status = os.stat(f"/proc/self/fd/{fd}")
            found.add((int(fd), status.st_dev, status.st_ino))
    return found


def _send_many(index: int, out: mp.Queue, warmed, received, leftover: mp.Queue, count: int) -> None:
    out.put(torch.zeros(16))
    assert warmed.wait(_DEADLINE_S)
    baseline = _descriptors()
    for k in range(count):
        out.put(torch.full((16,), float(k)))
    assert received.wait(_DEADLINE_S)
    # multiprocessing's sharer thread closes the descriptors of a hand-over (the tensor's, the connection) just
    # after the receiver has the tensor: the warm-up's may still have been open at the baseline, and the last
    # tensor's may still be open here. So a leak is a descriptor open now that was not open at the baseline,
    # told apart by what it refers to, not by its number, which the kernel reuses.
    def opened_since() -> set[tuple[int, int, int]]:
        return _descriptors() - baseline

    with contextlib.suppress(TimeoutError):
        wait_until(lambda: not opened_since(), "the sender has closed what it opened since its baseline", timeout=5)
    leftover.put(len(opened_since()))


def test_open_descriptors_return_to_their_baseline_after_10000_tensors(contexts) -> None:
    count = 10_000
    out, leftover = _SPAWN.Queue(), _SPAWN.Queue()
    warmed, received = _SPAWN.Event(), _SPAWN.Event()
    context = mp.spawn(_send_many, args=(out, warmed, received, leftover, count), join=False)
    contexts.append(context)
    out.get(timeout=_DEADLINE_S)  # the warm-up tensor, dropped at once
    baseline = _fds()
    warmed.set()
    total = 0.0
    for _ in range(count):
        total += out.get(timeout=_DEADLINE_S)[0].item()
    received.set()
    assert total == sum(range(count))
    assert leftover.get(timeout=_DEADLINE_S) == 0, "descriptors left open in the sender"
    assert _fds() == baseline, "descriptors left open in the receiver"
    _join(context)


def _send_forever(index: int, out: mp.Queue) -> None:
    while True:
        out.put(torch.randn(1000))


def _memfd_mappings() -> int:
    with open("/proc/self/maps") as f:
        return len(re.findall("memfd:shoal-tensor", f.read()))


def test_no_shared_memory_remains_after_children_are_killed_mid_transfer(contexts) -> None:
    before = set(os.listdir("/dev/shm"))
    out = _SPAWN.Queue()
    context = mp.spawn(_send_forever, args=(out,), nprocs=2, join=False)
    contexts.append(context)
    received = [out.get(timeout=_DEADLINE_S) for _ in range(20)]
    for pid in context.pids():
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(mp.ProcessExitedException, match="killed by SIGKILL"):
        _join(context)
    assert all(t.shape == (1000,) for t in received) and _memfd_mappings() > 0
    del received, out  # the queue's own semaphores live in /dev/shm until it goes
    gc.collect()
    assert _memfd_mappings() == 0
    assert set(os.listdir("/dev/shm")) <= before


def test_only_the_descriptor_sharing_strategy_is_offered() -> None:
    assert mp.get_all_sharing_strategies() == {"file_descriptor"} and mp.get_sharing_strategy() == "file_descriptor"
    mp.set_sharing_strategy("file_descriptor")
    with pytest.raises(ValueError, match="'file_system' is not offered"):
        mp.set_sharing_strategy("file_system")


def test_hogwild_example_trains_one_shared_model_as_well_as_a_single_process() -> None:
    accuracies = []
    for processes in ("1", "2"):
        result = subprocess.run([sys.executable, str(ROOT / "examples" / "hogwild.py"), "--num-processes", processes,
                                 "--epochs", "3"], capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        accuracies.append(float(re.search(r"test accuracy ([\d.]+)%", result.stdout).group(1)))
    single, hogwild = accuracies
    assert single > 50.0 and hogwild >= single - 2.0, accuracies
