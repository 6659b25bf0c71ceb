"""shoal.rpc between real worker processes: calls, futures, remote references and their reference
counting, errors, timeouts, dead callees, authentication and graceful shutdown."""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import threading
import time
import types
import weakref
from pathlib import Path

import pytest
import torch

import shoal
import shoal.distributed as dist
from shoal import rpc
from shoal.comm.shm import lanes
from shoal.comm.transport import auth
from shoal.rpc.agent import riders
from shoal.rpc.current import current_agent
from shoal.rpc.functions import runs_on_reader
from tests.ranks import run_ranks, run_rpc_ranks
from tests.waiting import wait_until


def _init(rank: int, world: int, port: int, **options) -> None:
    options.setdefault("rpc_timeout", 30.0)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world,
                 rpc_backend_options=rpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", **options))


# ---- functions and classes the workers call on each other (importable by reference) -----------

def add(a, b):
    return a + b


def whoami() -> str:
    return rpc.get_worker_info().name


def scaled(tensors: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {name: t * factor for name, t in tensors.items()}


def chain(names: list[str], value: int) -> list[str]:
    """Pass the call on along `names`, each worker appending its own name on the way back."""
    if names:
        return [*rpc.rpc_sync(names[0], chain, args=(names[1:], value + 1)), whoami()]
    return [f"{whoami()}:{value}"]


def call_back(caller: str) -> str:
    return "back from " + rpc.rpc_sync(caller, whoami)


class Counter:
    alive: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, start: int) -> None:
        self.value = start
        Counter.alive.add(self)

    def add(self, amount: int) -> int:
        self.value += amount
        return self.value


def live_counters() -> int:
    gc.collect()
    return len(Counter.alive)


def owned_objects() -> int:
    return len(current_agent().rref_context.table)


def bump(rref: rpc.RRef, amount: int) -> int:
    return rref.rpc_sync().add(amount)


def keep(rref: rpc.RRef) -> None:
    _kept.append(rref)


def drop_kept() -> None:
    _kept.clear()
    gc.collect()


def use_kept(amount: int) -> int:
    return _kept[0].rpc_sync().add(amount)


_kept: list = []


class NeedsTwoArguments(Exception):
    def __init__(self, a, b) -> None:
        super().__init__(f"{a}/{b}")


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this __str__ fails")


def fail_with(kind: str) -> None:
    if kind == "value":
        raise ValueError("bad value 42")
    if kind == "exit":
        sys.exit(3)
    if kind == "unprintable":
        raise UnprintableError()
    raise NeedsTwoArguments("x", "y")


def sleep_then(seconds: float, value):
    time.sleep(seconds)  # the remote work itself, not a wait for another process
    return value


_release = threading.Event()


def block_until_released() -> str:
    _release.wait(60)
    return "released"


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def rpc_listener() -> tuple[str, int]:
    return tuple(current_agent().transport.address)


# ---- calls and futures ------------------------------------------------------------------------

def _calls(rank: int, world: int) -> dict:
    out = {}
    if rank == 0:
        x = torch.randn(5, 3, dtype=torch.float64)
        out["sync"] = (rpc.rpc_sync("w1", add, args=(x, 2)), x + 2)
        out["kwargs"] = rpc.rpc_sync(1, add, kwargs={"a": "a", "b": "b"})
        tensors = {"big": torch.arange(1 << 20, dtype=torch.float32), "int": torch.arange(6).view(2, 3).t()}
        got = rpc.rpc_sync(rpc.get_worker_info("w1"), scaled, args=(tensors, 3))
        out["tensors"] = (got, {k: t * 3 for k, t in tensors.items()})
        futures = [rpc.rpc_async("w1", add, args=(i, i)) for i in range(20)]
        out["async"] = [f.wait() for f in futures]
        chained = rpc.rpc_async("w1", add, args=(1, 2)).then(lambda fut: fut.value() * 10)
        out["then"] = chained.wait()
        out["done"] = futures[0].done()
        out["self"] = rpc.rpc_sync("w0", whoami)
        out["info"] = (rpc.get_worker_info(), rpc.get_worker_info(1))
        counter = rpc.remote("w1", Counter, args=(5,))
        out["remote"] = (counter.rpc_sync().add(3), counter.rpc_async().add(1).wait(), counter.to_here().value,
                         counter.owner().name, counter.is_owner())
        out["remote_tensor"] = rpc.remote("w1", add, args=(torch.ones(4), 1)).to_here()
        local = rpc.RRef(torch.zeros(2))
        out["local"] = (local.is_owner(), local.to_here(), local.owner_name())
        with pytest.raises(RuntimeError, match=r"local_value.*owner"):
            counter.local_value()
        with pytest.raises(ValueError, match="no worker is named 'nobody'"):
            rpc.rpc_sync("nobody", whoami)
        with pytest.raises(TypeError, match="lambdas"):
            rpc.rpc_sync("w1", lambda: 1)
    return out


def test_sync_async_remote_and_to_here_with_tensors_and_plain_values() -> None:
    out = run_rpc_ranks(_calls, 2, timeout=90)[0]
    exact = {"rtol": 0, "atol": 0}  # what was sent, bit for bit, dtype and all
    torch.testing.assert_close(*out["sync"], **exact)
    torch.testing.assert_close(*out["tensors"], **exact)
    assert out["async"] == [2 * i for i in range(20)]
    torch.testing.assert_close(out["remote_tensor"], torch.full((4,), 2.0), **exact)
    assert out["kwargs"] == "ab"
    assert out["then"] == 30 and out["done"]
    assert out["self"] == "w0"
    assert out["info"] == (rpc.WorkerInfo("w0", 0), rpc.WorkerInfo("w1", 1))
    assert out["remote"] == (8, 9, 9, "w1", False)
    is_owner, value, owner = out["local"]
    assert (is_owner, owner) == (True, "w0")
    torch.testing.assert_close(value, torch.zeros(2), **exact)


def _nested(rank: int, world: int) -> dict:
    out = {}
    if rank == 0:
        out["chain"] = rpc.rpc_sync("w1", chain, args=(["w2"], 0))
        out["back"] = rpc.rpc_sync("w1", call_back, args=("w0",))
        out["ring"] = rpc.rpc_sync("w1", chain, args=(["w2", "w0", "w1"], 0))
    return out


_kept_tensors: list[torch.Tensor] = []


def keep_tensor(tensor: torch.Tensor) -> torch.Tensor:
    _kept_tensors.append(tensor)
    return tensor * 2


def uniform_values(tensors: list[torch.Tensor]) -> list[float | None]:
    """The value each tensor holds everywhere, or None for one whose elements differ (overwritten)."""
    return [t[0].item() if bool(torch.all(t == t[0])) else None for t in tensors]


def kept_values() -> list[float | None]:
    return uniform_values(_kept_tensors)


def _large_tensors_kept(rank: int, world: int) -> dict:
    out = {}
    if rank == 0:
        # More 1 MiB tensors than the shared-memory lanes have slots, each kept alive on both sides:
        # the ones that arrived in a lent slot must keep their values while later ones travel.
        count = 2 * lanes.SLOTS
        doubled = [rpc.rpc_sync("w1", keep_tensor, args=(torch.full((1 << 18,), float(i)),)) for i in range(count)]
        out["doubled"] = uniform_values(doubled)
        out["kept"] = rpc.rpc_sync("w1", kept_values)
        out["expected"] = list(range(count))
    return out


def test_large_tensors_kept_by_both_sides_keep_their_values() -> None:
    out = run_rpc_ranks(_large_tensors_kept, 2, timeout=90)[0]
    assert out["kept"] == out["expected"]
    assert out["doubled"] == [2 * v for v in out["expected"]]


def echo(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return tensors


def _both_message_paths(rank: int, world: int) -> dict:
    out = {}
    if rank == 0:
        from shoal.rpc.agent import INLINE_BYTES

        small = [torch.tensor([7], dtype=torch.uint8), torch.randn(5, dtype=torch.complex128), torch.arange(3.0)]
        # Past the limit by one byte: every tensor of the message goes as a frame of its own.
        large = [torch.tensor([1], dtype=torch.uint8), torch.randn(INLINE_BYTES // 8, dtype=torch.float64)]
        for name, tensors in (("small", small), ("large", large)):
            future = rpc.rpc_async("w1", echo, args=(tensors,))
            sent = [t.clone() for t in tensors]
            for tensor in tensors:
                tensor.zero_()  # once rpc_async returns, the caller may change what it sent
            out[name] = (future.wait(), sent)
    return out


def test_small_and_large_messages_arrive_equal_and_the_caller_may_reuse_its_tensors_at_once() -> None:
    out = run_rpc_ranks(_both_message_paths, 2, timeout=60)[0]
    assert sorted(out) == ["large", "small"]
    for name, (back, sent) in out.items():
        torch.testing.assert_close(back, sent, rtol=0, atol=0, msg=lambda m, name=name: f"{name} message: {m}")


_noted: list[tuple[str, str]] = []


def note_thread(label: str) -> None:
    _noted.append((label, threading.current_thread().name))


@runs_on_reader
def note_thread_on_reader(label: str) -> None:
    note_thread(label)


def noted_threads() -> list[tuple[str, str]]:
    return list(_noted)


def _notices(rank: int, world: int) -> list[tuple[str, str]]:
    noted = []
    if rank == 0:
        agent = current_agent()
        agent.notify("w1", note_thread, ("pool",))
        agent.notify("w1", note_thread_on_reader, ("reader",))
        wait_until(lambda: len(rpc.rpc_sync("w1", noted_threads)) == 2, "both notices have run on w1")
        noted = sorted(rpc.rpc_sync("w1", noted_threads))
    return noted


def test_a_notice_runs_on_the_pool_unless_its_function_runs_on_the_reader() -> None:
    (pool, pool_thread), (reader, reader_thread) = run_rpc_ranks(_notices, 2, timeout=60)[0]
    assert (pool, reader) == ("pool", "reader")
    assert pool_thread.startswith("shoal-rpc-w1") and reader_thread == "shoal-read-0"


_told = threading.Event()


def tell() -> None:
    _told.set()


def _notices_sent_soon(rank: int, world: int, port: int, ride: bool) -> list[str]:
    """Rank 0 sends w1 a notice soon. To ride, it then calls w1, and the notice may wait an hour for
    a message, so only that call can bring it; else it calls w1 no more, and the notice goes alone.
    Each rank reports the notices it got after shutdown, when every call to it is done."""
    riders.WAIT_S = 3600.0 if ride else 0.02
    _init(rank, world, port)
    if rank == 0:
        agent = current_agent()
        alone = []
        waiting = agent._notices._riders
        send_alone = waiting._send_alone
        waiting._send_alone = lambda dst, riders: (alone.append(dst), send_alone(dst, riders))
        agent.notify_soon("w1", note_thread_on_reader, ("soon",))
        if ride:
            wait_until(lambda: rpc.rpc_sync("w1", noted_threads) != [], "the notice has ridden on a call to w1")
            assert alone == []
        else:
            assert _told.wait(20.0), "w1 never got the notice"
            assert alone == [1]
    elif not ride:
        wait_until(lambda: _noted != [], "the notice has arrived alone")
        rpc.rpc_sync("w0", tell)
    rpc.shutdown()
    return [label for label, _ in _noted]


def test_a_notice_sent_soon_rides_on_the_next_call_to_its_worker() -> None:
    assert run_ranks(_notices_sent_soon, 2, True, backend=None, timeout=60)[1] == ["soon"]


def test_a_notice_sent_soon_with_nothing_to_ride_on_goes_alone() -> None:
    assert run_ranks(_notices_sent_soon, 2, False, backend=None, timeout=60)[1] == ["soon"]


def test_nested_calls_and_a_call_back_to_the_caller() -> None:
    out = run_rpc_ranks(_nested, 3, options={"num_worker_threads": 4}, timeout=90)[0]
    assert out["chain"] == ["w2:1", "w1"]
    assert out["back"] == "back from w0"
    assert out["ring"] == ["w1:3", "w0", "w2", "w1"]


# ---- remote references ------------------------------------------------------------------------

def _rref_sharing(rank: int, world: int) -> dict:
    out = {}
    if rank == 0:
        counter = rpc.remote("w1", Counter, args=(0,))
        out["third"] = rpc.rpc_sync("w2", bump, args=(counter, 5))  # w2 uses it on w1
        out["owner_gets_it_back"] = rpc.rpc_sync("w1", bump, args=(counter, 1))  # the owner's own RRef
        mine = rpc.RRef(Counter(100))  # owned here, used there
        out["local_owner"] = rpc.rpc_sync("w2", bump, args=(mine, 1))
        # ... and here, through the proxy and as an argument to ourselves: the owner's own RRef
        # sent to the owner makes a fork like any other, and finds its object.
        out["own_proxy"] = (mine.rpc_sync().add(1), rpc.rpc_sync("w0", bump, args=(mine, 1)))
        out["values"] = (counter.to_here().value, mine.local_value().value)
    return out


def test_rref_passed_to_a_third_worker_is_used_there() -> None:
    out = run_rpc_ranks(_rref_sharing, 3, timeout=90)[0]
    assert out == {"third": 5, "owner_gets_it_back": 6, "local_owner": 101, "own_proxy": (102, 103),
                   "values": (6, 103)}


def _refcount(rank: int, world: int) -> dict:
    out = {}
    if rank == 0:
        # Dropped by its only holder: freed on the owner.
        lone = rpc.remote("w1", Counter, args=(1,))
        lone.confirmed().wait()
        out["alive_while_held"] = rpc.rpc_sync("w1", live_counters)
        del lone
        gc.collect()
        wait_until(lambda: rpc.rpc_sync("w1", live_counters) == 0, "w1 has freed the dropped object")

        # Handed to w2 and dropped here at once: w2's reference keeps it alive, and it works there.
        shared = rpc.remote("w1", Counter, args=(10,))
        rpc.rpc_sync("w2", keep, args=(shared,))
        del shared
        gc.collect()
        out["after_sender_dropped"] = (rpc.rpc_sync("w2", use_kept, args=(1,)), rpc.rpc_sync("w1", live_counters))
        rpc.rpc_sync("w2", drop_kept)
        wait_until(lambda: rpc.rpc_sync("w1", live_counters) == 0, "w1 has freed the object after its last holder")

        # Many short-lived forks in flight: never freed early, and nothing left over afterwards.
        many = rpc.remote("w1", Counter, args=(0,))
        results = [rpc.rpc_async(f"w{1 + i % 2}", bump, args=(many, 1)) for i in range(40)]
        out["many"] = sorted(f.wait() for f in results)[-1]
        del many, results
        gc.collect()
        wait_until(lambda: rpc.rpc_sync("w1", owned_objects) == 0, "the owner's table on w1 is empty")
        out["end"] = (rpc.rpc_sync("w1", live_counters), rpc.rpc_sync("w1", owned_objects))
    return out


def test_reference_counting_frees_objects_and_never_early() -> None:
    # Each of the 40 `bump`s waits on a nested call to w1: more threads than calls in flight, so a burst
    # that lands before any nested call is served cannot fill the pool with waiters.
    out = run_rpc_ranks(_refcount, 3, options={"num_worker_threads": 48}, timeout=100)[0]
    assert out["alive_while_held"] == 1
    assert out["after_sender_dropped"] == (11, 1)
    assert out["many"] == 40
    assert out["end"] == (0, 0)


# ---- errors -----------------------------------------------------------------------------------

def _errors(rank: int, world: int) -> dict:
    out = {}
    if rank == 0:
        try:
            rpc.rpc_sync("w1", fail_with, args=("value",))
        except ValueError as exc:
            out["value"] = (str(exc), type(exc.__cause__).__name__, str(exc.__cause__))
        try:
            rpc.rpc_sync("w1", fail_with, args=("odd",))
        except rpc.RemoteError as exc:
            out["odd"] = str(exc)
        broken = rpc.remote("w1", fail_with, args=("value",))
        with pytest.raises(ValueError, match="bad value 42"):
            broken.to_here()
        # sys.exit() in a remote function: reported at once, and it does not end the caller.
        with pytest.raises(rpc.RemoteError, match="SystemExit: 3"):
            rpc.rpc_sync("w1", fail_with, args=("exit",), timeout=20)
        with pytest.raises(rpc.RemoteError, match="SystemExit: 3"):
            rpc.remote("w1", fail_with, args=("exit",), timeout=20).to_here()
        with pytest.raises(UnprintableError):  # reported although its message cannot be made
            rpc.rpc_sync("w1", fail_with, args=("unprintable",), timeout=20)
        # A function the callee cannot import: defined in a module only the caller has.
        module = types.ModuleType("only_on_w0")
        exec("def f():\n    return 1\n", module.__dict__)
        sys.modules["only_on_w0"] = module
        with pytest.raises(rpc.UnknownFunctionError, match=r"worker 'w1' has no function only_on_w0\.f"):
            rpc.rpc_sync("w1", module.f)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"did not complete within 0\.5s"):
            rpc.rpc_sync("w1", sleep_then, args=(5.0, None), timeout=0.5)
        out["timeout_waited"] = time.monotonic() - start
        out["after_timeout"] = rpc.rpc_sync("w1", add, args=(2, 3))
    return out


def test_remote_errors_keep_type_message_and_traceback_and_timeouts_raise() -> None:
    out = run_rpc_ranks(_errors, 2, timeout=90)[0]
    message, cause, remote_traceback = out["value"]
    assert message == "bad value 42" and cause == "RemoteTraceback"
    assert "on worker 'w1'" in remote_traceback and "in fail_with" in remote_traceback
    assert "NeedsTwoArguments" in out["odd"] and "x/y" in out["odd"]
    assert out["timeout_waited"] < 5.0  # it raised at its own deadline, not when the work ended
    assert out["after_timeout"] == 5


def _killed(rank: int, world: int) -> dict:
    out = {}
    if rank == 0:
        pending = [rpc.rpc_async("w1", block_until_released) for _ in range(3)]
        rpc.rpc_async("w1", die)
        errors = []
        for future in pending:
            try:
                future.wait()
            except Exception as exc:
                errors.append(exc)
        out["pending"] = [(type(e).__name__, getattr(e, "rank", None)) for e in errors]
        with pytest.raises(shoal.PeerFailure, match="w1"):
            rpc.rpc_sync("w1", whoami)
        out["survivor"] = rpc.rpc_sync("w2", whoami)
    if rank == 1:
        _release.wait(120)  # killed long before
    return out


def test_callee_killed_mid_call_fails_every_pending_call_with_peer_failure() -> None:
    out = run_rpc_ranks(_killed, 3, options={"rpc_timeout": 60.0}, timeout=100, expect={1: "dies"})[0]
    assert out["pending"] == [("PeerFailure", 1)] * 3
    assert out["survivor"] == "w2"


def _intruder(rank: int, world: int) -> str:
    if rank == 0:
        host, listen_port = rpc.rpc_sync("w1", rpc_listener)
        marker = Path(os.environ["SHOAL_TEST_MARKER"])
        # A pickle that would create the marker file if anything unpickled it.
        payload = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
        with socket.create_connection((host, listen_port), timeout=10) as raw:
            raw.sendall(payload * 8)
            try:
                assert raw.recv(1) == b""
            except ConnectionResetError:
                pass
        with socket.create_connection((host, listen_port), timeout=10) as wrong, pytest.raises(
                auth.AuthenticationError):
            auth.client_handshake(wrong, b"not the secret", b"session", my_rank=0, peer_rank=1)
        assert not marker.exists()
        result = rpc.rpc_sync("w1", whoami)
    else:
        result = ""
    return result


def test_unauthenticated_connection_is_rejected_and_nothing_is_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    out = run_rpc_ranks(_intruder, 2, timeout=60, env={"SHOAL_TEST_MARKER": str(marker)})
    assert out[0] == "w1" and not marker.exists()


# ---- shutdown and start-up --------------------------------------------------------------------

def _graceful(rank: int, world: int, port: int) -> list:
    _init(rank, world, port)
    futures = []
    if rank == 0:
        futures = [rpc.rpc_async("w1", sleep_then, args=(0.5, torch.full((3,), float(i)))) for i in range(4)]
        futures.append(rpc.rpc_async("w2", sleep_then, args=(1.0, "slow")))
    rpc.shutdown()  # w1 and w2 get here at once, and must keep serving until w0 is done
    return [f.done() and (f.value().tolist() if isinstance(f.value(), torch.Tensor) else f.value())
            for f in futures]


def test_graceful_shutdown_completes_calls_in_flight() -> None:
    out = run_ranks(_graceful, 3, backend=None, timeout=90)
    assert out[0] == [[0.0] * 3, [1.0] * 3, [2.0] * 3, [3.0] * 3, "slow"]


def _shutdown_while_serving(rank: int, world: int, port: int) -> str:
    _init(rank, world, port)
    if rank == 0:
        with pytest.raises(TimeoutError):
            rpc.rpc_sync("w1", block_until_released, timeout=0.5)  # w1 goes on serving it
    rpc.shutdown(timeout=3)
    state = "returned while serving" if not _release.is_set() else "returned after the call"
    _release.set()  # let the served call end, so that this process can exit
    return state


def test_graceful_shutdown_is_bounded_by_its_timeout_even_while_serving_a_call() -> None:
    # The served call waits up to 60 s: without the bound, w1's shutdown outlives the test's deadline.
    out = run_ranks(_shutdown_while_serving, 2, backend=None, timeout=40)
    assert out == {0: "returned while serving", 1: "returned while serving"}


def _lifecycle(rank: int, world: int, port: int) -> dict:
    _init(rank, world, port)
    out = {}
    if rank == 0:
        mine = rpc.remote("w0", Counter, args=(5,))  # owned here, held by the local RRef alone
        out["own_remote"] = (mine.to_here().value, owned_objects())
        del mine
        # The pool thread that made it may still be finishing (its frames hold the object a moment).
        wait_until(lambda: live_counters() == 0, "the dropped object is freed")
        out["own_remote_freed"] = (live_counters(), owned_objects())
        # A callback that makes an RPC of its own is outstanding work: shutdown waits for it.
        later = rpc.rpc_async("w1", sleep_then, args=(0.3, 1))
        chained = later.then(lambda done: rpc.rpc_sync("w1", add, args=(done.value(), 1)))
    rpc.shutdown()
    if rank == 0:
        out["chained"] = chained.done() and chained.value()
    out["threads_left"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("shoal"))
    return out


def test_shutdown_waits_for_callbacks_frees_own_remotes_and_leaves_no_thread() -> None:
    out = run_ranks(_lifecycle, 2, backend=None, timeout=60)
    assert out[0] == {"own_remote": (5, 0), "own_remote_freed": (0, 0), "chained": 2, "threads_left": []}
    assert out[1] == {"threads_left": []}


def _with_process_group(rank: int, world: int, port: int) -> tuple:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("shoal")
    rpc.init_rpc(f"trainer{rank}")
    tensor = torch.full((4,), float(rank + 1))
    dist.all_reduce(tensor)
    name = rpc.rpc_sync((rank + 1) % world, whoami)
    rpc.shutdown()
    rpc.init_rpc(f"again{rank}")  # a second RPC group on the store the process group still holds
    name += " " + rpc.rpc_sync((rank + 1) % world, whoami)
    rpc.shutdown()
    dist.barrier()  # the process group outlives RPC on the shared store
    dist.destroy_process_group()
    return tensor.tolist(), name


def test_rpc_and_a_process_group_share_the_rendezvous() -> None:
    out = run_ranks(_with_process_group, 2, backend=None, timeout=60)
    assert out == {0: ([3.0] * 4, "trainer1 again1"), 1: ([3.0] * 4, "trainer0 again0")}


def _duplicate_names(rank: int, world: int, port: int) -> str:
    with pytest.raises(ValueError, match="name 'same' is taken by ranks \\[0, 1\\]"):
        rpc.init_rpc("same", rank=rank, world_size=world,
                     rpc_backend_options=rpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}"))
    return "refused"


def test_duplicate_worker_names_are_refused() -> None:
    assert run_ranks(_duplicate_names, 2, backend=None, timeout=60) == {0: "refused", 1: "refused"}
