"""The pieces of shoal.rpc that need no second process: the owner's reference counting, futures,
functions sent by reference, the message encoding, and the thread pool that serves calls."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import pickle
import threading
import time
import types
import weakref
from collections.abc import Iterator

import pytest
import torch

from shoal.rpc import Future
from shoal.rpc.agent import Riders, WorkerPool
from shoal.rpc.agent.wire import _carried, _with_tensors
from shoal.rpc.headers import AutogradTag, ForkChange, Mode, Request, Response
from shoal.rpc.message import RemoteError, RemoteTraceback, decode, encode, function_ref, pack_error, unpack_error
from shoal.rpc.rref import make_rref, reference_of
from shoal.rpc.rref_context import OwnerTable, Reference, RRefContext
from tests.threads import linux_only, named, voluntary_switches

# ---- the owner's table ------------------------------------------------------------------------

def test_an_object_lives_while_any_fork_does_and_is_released_after_the_last() -> None:
    table = OwnerTable()
    entry = table.created_remotely((0, 1), (0, 2), holder=0)
    table.add_fork((0, 1), (0, 3), holder=2)  # the creator passed it on
    table.delete_fork((0, 1), (0, 2))  # the creator dropped its own
    assert len(table) == 1
    table.delete_fork((0, 1), (0, 3))
    assert len(table) == 0
    assert entry.forks == {}


def test_a_delete_that_overtakes_its_add_is_not_lost() -> None:
    table = OwnerTable()
    table.created_remotely((0, 1), (0, 2), holder=0)
    table.delete_fork((0, 1), (0, 9))  # the child's delete arrives first, on its own connection
    assert len(table) == 1
    table.add_fork((0, 1), (0, 9), holder=2)  # the parent's add cancels against the tombstone
    table.delete_fork((0, 1), (0, 2))
    assert len(table) == 0


def test_a_fetch_before_the_creating_call_waits_for_it() -> None:
    table = OwnerTable()
    early = table.entry((0, 1))  # a fetch named the id before remote() arrived
    assert not early.value.done()
    entry = table.created_remotely((0, 1), (0, 2), holder=0)
    assert entry is early
    entry.value.set_result("made")
    assert early.value.wait(0) == "made"


def test_a_dead_workers_forks_are_dropped() -> None:
    table = OwnerTable()
    table.created_remotely((0, 1), (0, 2), holder=0)
    table.add_fork((0, 1), (0, 3), holder=2)
    table.drop_holder(2)
    assert len(table) == 1
    table.drop_holder(0)
    assert len(table) == 0


def test_an_owner_local_entry_joins_the_table_only_while_forked() -> None:
    table = OwnerTable()
    entry = table.local((1, 0), "value")
    assert len(table) == 0
    table.add_fork(entry, (1, 1), holder=0)
    assert len(table) == 1
    table.delete_fork((1, 0), (1, 1))
    assert len(table) == 0 and entry.value.wait(0) == "value"


# for RRefs made by hand: their releases go nowhere
_NO_AGENT = types.SimpleNamespace(rref_context=types.SimpleNamespace(release=lambda reference: None))


def _context(rank: int, told: list) -> RRefContext:
    ids = iter(range(100, 200))
    return RRefContext(rank, lambda: (rank, next(ids)), lambda owner, change: told.append((owner, change)),
                       lambda reference, created: make_rref(_NO_AGENT, reference, created), f"w{rank}")


def test_an_rref_sent_to_its_owner_makes_no_fork_and_one_sent_elsewhere_does() -> None:
    told: list = []
    holder = _context(1, told)  # worker 1 holds a reference to object (0, 5), owned by worker 0
    rref = make_rref(_NO_AGENT, Reference(0, (0, 5), (1, 7)))
    home = holder.encode_for(0, rref)
    assert told == []  # going home: nothing to tell the owner first
    elsewhere = holder.encode_for(2, rref)
    assert [(owner, change.action, change.holder) for owner, change in told] == [(0, "add", 2)]

    owner = _context(0, [])
    entry = owner.table.created_remotely((0, 5), (1, 7), holder=1)
    adopted = decode(home.body, [], owner.adopt)
    assert adopted.is_owner() and reference_of(adopted).entry is entry and entry.forks == {(1, 7): 1}  # no tombstone
    assert reference_of(decode(elsewhere.body, [], _context(2, []).adopt)).fork_id == told[0][1].fork_id
    for context in (holder, owner):
        context.stop(timeout=5)


def test_an_rref_sent_home_before_its_creating_call_arrives_waits_for_that_call() -> None:
    told: list = []
    holder = _context(2, told)  # worker 2 got a fork of (0, 5) from its creator, worker 1
    home = holder.encode_for(0, make_rref(_NO_AGENT, Reference(0, (0, 5), (1, 8))))
    owner = _context(0, [])
    adopted = decode(home.body, [], owner.adopt)  # the creator's remote() call is still on its way
    assert not reference_of(adopted).entry.value.done()
    entry = owner.table.created_remotely((0, 5), (1, 7), holder=1)
    entry.value.set_result("made")
    assert reference_of(adopted).entry is entry and entry.value.wait(0) == "made"
    for context in (holder, owner):
        context.stop(timeout=5)


# ---- futures ----------------------------------------------------------------------------------

def test_future_then_chains_values_and_errors() -> None:
    first: Future[int] = Future()
    doubled = first.then(lambda f: f.value() * 2)
    failed = doubled.then(lambda f: 1 / 0)
    assert not doubled.done()
    first.set_result(21)
    assert doubled.wait(1) == 42
    with pytest.raises(ZeroDivisionError):
        failed.wait(1)
    with pytest.raises(RuntimeError, match="already completed"):
        first.set_result(0)


def test_future_wait_timeout_and_value_before_done() -> None:
    future: Future[int] = Future()
    with pytest.raises(ValueError, match="not done"):
        future.value()
    with pytest.raises(TimeoutError):
        future.wait(0.01)
    threading.Timer(0.01, future.set_exception, args=(KeyError("k"),)).start()
    with pytest.raises(KeyError):
        future.wait(5)


def test_every_thread_waiting_on_a_future_gets_its_value() -> None:
    future: Future[int] = Future()
    started = threading.Barrier(5)
    results: list[int] = []

    def wait() -> None:
        started.wait(5)
        results.append(future.wait(5))

    waiters = [threading.Thread(target=wait) for _ in range(4)]
    for waiter in waiters:
        waiter.start()
    started.wait(5)
    future.set_result(7)
    for waiter in waiters:
        waiter.join(10)
    assert results == [7, 7, 7, 7]
    assert future.wait(0) == 7  # and later waits return at once


class _InterruptedRelease:
    """A future's latch whose completer is interrupted (KeyboardInterrupt) just before releasing it."""

    def __init__(self, latch: threading.Lock) -> None:
        self._latch = latch

    def acquire(self, timeout: float) -> bool:
        return self._latch.acquire(timeout=timeout)

    def release(self) -> None:
        raise KeyboardInterrupt


def test_a_waiter_wakes_once_the_future_is_done_even_if_the_latch_is_never_handed_over() -> None:
    future: Future[int] = Future()
    future._latch = _InterruptedRelease(future._latch)
    asleep = threading.Event()
    results: list[int] = []

    def wait() -> None:
        asleep.set()
        results.append(future.wait(30))

    waiter = threading.Thread(target=wait)
    waiter.start()
    asleep.wait(5)
    with pytest.raises(KeyboardInterrupt):
        future.set_result(3)
    waiter.join(10)  # it looks at `done` again within a slice of its wait, not at its 30 s timeout
    assert results == [3]


# ---- functions by reference -------------------------------------------------------------------

class _Holder:
    @staticmethod
    def static(x: int) -> int:
        return x

    def method(self) -> None:
        pass


def test_functions_are_sent_by_module_and_name() -> None:
    assert function_ref(math.sqrt) == ("math", "sqrt")
    assert function_ref(torch.add) == ("torch", "add")
    assert function_ref(torch.nn.Linear) == ("torch.nn.modules.linear", "Linear")
    assert function_ref(_Holder.static) == (__name__, "_Holder.static")


def test_functions_without_a_reference_are_refused_on_the_caller() -> None:
    def nested() -> None:
        pass

    for func in (lambda: 1, nested):
        with pytest.raises(TypeError, match="top level of a module"):
            function_ref(func)
    with pytest.raises(TypeError, match="bound method"):
        function_ref(_Holder().method)


# ---- message encoding -------------------------------------------------------------------------

def _wire(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the receiver has after the frames arrive: fresh byte buffers with the same contents."""
    return [t.clone() for t in tensors]


def test_tensors_travel_out_of_band_and_come_back_equal() -> None:
    base = torch.arange(24, dtype=torch.float64).view(4, 6)
    values = {
        "transposed": base.t(),  # not contiguous
        "slice": base[1:3, 2:],  # a view with an offset
        "scalar": torch.tensor(3.5),
        "bool": torch.tensor([True, False, True]),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "empty": torch.empty(0, 3),
        "grad": torch.ones(2, requires_grad=True),
        "param": torch.nn.Parameter(torch.zeros(3)),
    }
    message = encode({"values": values, "again": values["scalar"], "text": "plain"})
    assert len(message.tensors) == len(values)  # the repeated tensor travels once
    out = decode(message.body, _wire(message.tensors))
    for name, tensor in values.items():
        got = out["values"][name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor.detach()), name
    assert out["values"]["grad"].requires_grad and isinstance(out["values"]["param"], torch.nn.Parameter)
    assert out["again"] is out["values"]["scalar"] and out["text"] == "plain"


def test_a_received_tensor_is_freed_as_soon_as_the_body_is_dropped() -> None:
    """Nothing of the decoding keeps it: a tensor over a lent shared-memory slot holds the slot."""
    message = encode({"grad": torch.ones(4, requires_grad=True), "plain": torch.arange(3)})
    gc.disable()  # freed by reference counting alone, not by a collection that happens to run
    try:
        out = decode(message.body, _wire(message.tensors), None, {})
        refs = [weakref.ref(out["grad"]), weakref.ref(out["plain"])]
        del out
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()


def test_small_tensors_ride_in_one_frame_at_aligned_offsets_as_copies() -> None:
    values = {
        "odd_bytes": torch.tensor([1, 2, 3], dtype=torch.uint8),  # leaves the next tensor unaligned unless padded
        "complex": torch.randn(3, dtype=torch.complex128),
        "float64": torch.arange(5, dtype=torch.float64),
        "empty": torch.empty(0, dtype=torch.int32),
        "bool": torch.tensor([True, False]),
        "half": torch.randn(7).half(),
    }
    expected = {name: t.clone() for name, t in values.items()}
    message = encode(values)
    frame = _with_tensors(pickle.dumps(("header", message.body, [t.numel() for t in message.tensors])),
                          message.tensors)
    for tensor in values.values():
        tensor.zero_()  # the frame holds copies: the sender may change its tensors once it is built
    (header, body), carried = _carried(bytearray(frame))  # as received: a buffer of the receiver's own
    assert header == "header" and all(t.data_ptr() % 16 == 0 for t in carried if t.numel())
    out = decode(body, carried)
    for name, tensor in expected.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name


def test_every_header_field_survives_the_wire() -> None:
    """Headers pickle as their field values: a field added to the class but not to its
    __reduce__ would arrive as its default."""
    tag = AutogradTag(7 << 48 | 3, send_id=9, forwarded=((1, 2, 3, 4),))
    headers = [tag,
               Request(Mode.FETCH, ("m", "f"), (1, 2), (3, 4), tag, on_reader=True),
               Response(ok=False, autograd=tag),
               ForkChange("delete", (1, 2), (3, 4), holder=5)]
    for header in headers:
        assert len(header.__reduce__()[1]) == len(dataclasses.fields(header))
        assert pickle.loads(pickle.dumps(header)) == header
    for mode in Mode:  # the agent tells modes apart with `is`
        assert pickle.loads(pickle.dumps(mode)) is mode


def test_non_cpu_or_sparse_tensors_are_refused() -> None:
    with pytest.raises(TypeError, match="dense CPU tensors"):
        encode(torch.eye(3).to_sparse())


class _Odd(Exception):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(a + b)


def test_errors_keep_their_type_or_fall_back_with_the_type_name() -> None:
    try:
        raise ValueError("bad 7")
    except ValueError as exc:
        rebuilt = unpack_error(pack_error(exc, "w1"))
    assert type(rebuilt) is ValueError and str(rebuilt) == "bad 7"
    assert isinstance(rebuilt.__cause__, RemoteTraceback)
    assert "on worker 'w1'" in str(rebuilt.__cause__) and "raise ValueError" in str(rebuilt.__cause__)
    odd = unpack_error(pack_error(_Odd(1, 2), "w1"))
    assert isinstance(odd, RemoteError) and "_Odd" in str(odd) and "3" in str(odd)


def test_callbacks_that_torch_registers_see_the_future_done_and_may_add_their_own() -> None:
    future: Future[int] = Future()
    seen: list = []

    def on_all(_: torch.futures.Future) -> None:
        seen.append((future.done(), future.wait(1.0)))
        future.add_done_callback(lambda done: seen.append(done.value()))  # must not deadlock

    torch.futures.collect_all([future]).then(on_all)
    future.set_result(5)
    assert seen == [(True, 5), 5]


# ---- the pool that serves calls ------------------------------------------------------------------

def test_the_pool_starts_threads_as_calls_wait_up_to_its_limit_and_runs_every_call() -> None:
    pool = WorkerPool(3, "grow-pool")
    all_three_running = threading.Barrier(3)  # broken (and the test failed) if the pool never runs three at once
    ran, threads, lock = [], set(), threading.Lock()

    def call(i: int) -> None:
        if i < 3:
            all_three_running.wait(10)
        with lock:
            ran.append(i)
            threads.add((threading.current_thread().name, pool.on_own_thread()))

    for i in range(20):
        pool.submit(call, i)
    started = [t.name for t in threading.enumerate() if t.name.startswith("grow-pool")]
    pool.shutdown()
    pool.join(time.monotonic() + 10)
    assert sorted(ran) == list(range(20))
    assert sorted(started) == ["grow-pool_0", "grow-pool_1", "grow-pool_2"]
    assert {name for name, _ in threads} == set(started)
    assert all(own for _, own in threads) and not pool.on_own_thread()


def test_one_thread_runs_calls_in_the_order_submitted() -> None:
    pool, ran = WorkerPool(1, "order-pool"), []
    for i in range(100):
        pool.submit(ran.append, i)
    pool.shutdown()
    pool.join(time.monotonic() + 10)
    assert ran == list(range(100))


def test_a_call_that_raises_is_logged_and_the_pool_serves_on(caplog: pytest.LogCaptureFixture) -> None:
    pool, done = WorkerPool(1, "raise-pool"), threading.Event()
    pool.submit(math.sqrt, -1.0)
    pool.submit(done.set)
    assert done.wait(10)
    assert "raise-pool: a call on the pool raised" in caplog.text and "math domain error" in caplog.text
    pool.shutdown()
    pool.join(time.monotonic() + 10)


def test_a_shut_pool_refuses_calls_and_its_threads_end_after_those_queued() -> None:
    pool, gate, ran = WorkerPool(2, "shut-pool"), threading.Event(), []
    pool.submit(gate.wait, 10)
    pool.submit(ran.append, "queued")
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(ran.append, "late")
    gate.set()
    pool.join(time.monotonic() + 10)
    assert ran == ["queued"]
    assert not any(t.name.startswith("shut-pool") and t.is_alive() for t in threading.enumerate())


# ---- notices waiting to ride on a message -------------------------------------------------------

class _Sent:
    """Records what Riders sends alone, and lets a test wait for it."""

    def __init__(self) -> None:
        self.messages: list[tuple[int, tuple]] = []
        self.arrived = threading.Event()

    def __call__(self, dst: int, riders: tuple) -> None:
        self.messages.append((dst, riders))
        self.arrived.set()


def _rider(n: int) -> tuple:
    return (("module", "function"), False, (n,))


@contextlib.contextmanager
def _waiting(seconds: float) -> Iterator[None]:
    """Notices added meanwhile wait `seconds` for a message to ride on before going alone."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("shoal.rpc.agent.riders.WAIT_S", seconds)
        yield


def test_notices_wait_for_a_message_to_their_worker_and_ride_together() -> None:
    sent = _Sent()
    riders = Riders(sent, "test-riders")
    try:
        with _waiting(60.0):  # nothing goes alone during the test
            for n in range(3):
                riders.add(1, _rider(n))
            riders.add(2, _rider(9))
        assert riders.take(1) == (_rider(0), _rider(1), _rider(2))
        assert riders.take(1) == ()  # taken once: the message that carries them is the only one
        riders.drop(2)  # worker 2 died
        assert riders.take(2) == ()
        assert riders.flush(10.0) and sent.messages == []  # none left to send alone
    finally:
        riders.stop(5.0)


def test_a_notice_that_finds_no_message_goes_alone_and_only_once() -> None:
    sent = _Sent()
    riders = Riders(sent, "test-riders")
    try:
        with _waiting(0.5):  # both are in long before the first is due
            riders.add(3, _rider(1))
            riders.add(3, _rider(2))
        assert sent.arrived.wait(10.0), "the notices never went alone"
        assert riders.flush(10.0)  # anything sent twice would be sent by now
        assert sent.messages == [(3, (_rider(1), _rider(2)))]
        assert riders.take(3) == ()
    finally:
        riders.stop(5.0)


def test_a_notice_waits_its_own_time_even_after_an_earlier_one_to_its_worker_rode() -> None:
    sent = _Sent()
    riders = Riders(sent, "test-riders")
    try:
        with _waiting(1.0):
            riders.add(1, _rider(1))
        assert riders.take(1) == (_rider(1),)  # it rode on a message
        with _waiting(60.0):
            riders.add(1, _rider(2))
        time.sleep(2.0)  # the first notice's time comes and goes
        assert sent.messages == []  # the second is not sent alone on the first one's time
        assert riders.take(1) == (_rider(2),)
    finally:
        riders.stop(5.0)


@linux_only
def test_notices_that_ride_in_time_do_not_wake_the_thread() -> None:
    # A training loop: each step's notices ride on the next step's first call to their worker.
    sent = _Sent()
    riders = Riders(sent, "test-riders-asleep")
    thread = named("test-riders-asleep")
    try:
        with _waiting(60.0):
            riders.add(1, _rider(0))  # the thread learns when this one is due, and sleeps till then
            time.sleep(0.05)
            before = voluntary_switches(thread)
            for step in range(1, 201):
                assert riders.take(1) == (_rider(step - 1),)
                riders.add(1, _rider(step))
                time.sleep(0.001)  # the step's work, in which a woken thread would run (a late one is harmless)
        assert voluntary_switches(thread) - before < 20
        assert sent.messages == []
    finally:
        riders.stop(5.0)


def test_notices_still_waiting_are_sent_when_the_thread_stops() -> None:
    sent = _Sent()
    riders = Riders(sent, "test-riders")
    with _waiting(60.0):
        riders.add(1, _rider(1))
    riders.stop(10.0)
    assert sent.messages == [(1, (_rider(1),))]


def test_a_flush_sends_every_waiting_notice_at_once() -> None:
    sent = _Sent()
    riders = Riders(sent, "test-riders")
    try:
        with _waiting(60.0):
            riders.add(1, _rider(1))
            riders.add(2, _rider(2))
        assert riders.flush(10.0)  # long before the 60 s are up
        assert sorted(sent.messages) == [(1, (_rider(1),)), (2, (_rider(2),))]
    finally:
        riders.stop(5.0)


def test_a_request_with_riders_pickles_them_with_it() -> None:
    request = Request(Mode.CALL, ("m", "f"), riders=(_rider(1), _rider(2)))
    assert pickle.loads(pickle.dumps(request)) == request
