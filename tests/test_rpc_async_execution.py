"""@async_execution and futures between real workers: a callee answers when its future completes
and holds no thread meanwhile; shoal's RPC futures work with torch.futures' functions; torch's
backend options and init_rpc arguments are accepted as scripts pass them."""

from __future__ import annotations

import threading

import pytest
import torch

from shoal import rpc
from tests.ranks import run_ranks, run_rpc_ranks
from tests.waiting import wait_until

RPC_TIMEOUT = 20.0


def _init(rank: int, world: int, port: int, **options) -> None:
    """As a script written for torch.distributed.rpc starts: its backend and its options' class."""
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=RPC_TIMEOUT, init_method=f"tcp://127.0.0.1:{port}", **options)
    rpc.init_rpc(f"w{rank}", backend=rpc.BackendType.TENSORPIPE, rank=rank, world_size=world,
                 rpc_backend_options=options)


def add(a, b):
    return a + b


@rpc.functions.async_execution
def add_then_double(to: str, a, b) -> rpc.Future:
    """Answers with a nested call's result, transformed, without waiting on a thread."""
    return rpc.rpc_async(to, add, args=(a, b)).then(lambda done: done.value() * 2)


@rpc.functions.async_execution
def answered_by_a_timer(value: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    threading.Timer(0.05, lambda: future.set_result(value + 1)).start()
    return future


@rpc.functions.async_execution
def fails_later() -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    threading.Timer(0.05, lambda: future.set_exception(KeyError("missing later"))).start()
    return future


@rpc.functions.async_execution
def forgets_the_future() -> int:
    return 3


class BatchingServer:
    """Answers every caller of a round once all `callers` have sent their part: with
    @async_execution the waiting callers hold no thread, so one thread serves all of them."""

    def __init__(self, callers: int) -> None:
        self.callers = callers
        self.lock = threading.Lock()
        self.parts: list[torch.Tensor] = []
        self.round = torch.futures.Future()

    @rpc.functions.async_execution
    def contribute(self, part: torch.Tensor) -> torch.futures.Future:
        with self.lock:
            self.parts.append(part)
            current = self.round
            if len(self.parts) == self.callers:
                total, self.parts, self.round = torch.stack(self.parts).sum(0), [], torch.futures.Future()
                current.set_result(total)
        return current

    @staticmethod
    @rpc.functions.async_execution
    def contribute_to(server: rpc.RRef, part: torch.Tensor) -> torch.futures.Future:
        return server.local_value().contribute(part)


def _async_calls(rank: int, world: int, port: int) -> dict:
    _init(rank, world, port, num_worker_threads=1 if rank == 0 else 4)
    out: dict = {}
    if rank in (1, 2):
        mine = rpc.rpc_sync("w0", shared_server)
        part = torch.full((3,), float(rank))
        # Both rounds wait on w0 at once, though w0 has a single thread to serve calls with.
        via_static = rpc.rpc_sync("w0", BatchingServer.contribute_to, args=(mine, part))
        via_proxy = mine.rpc_sync().contribute(part * 10)
        out["batched"] = (via_static.tolist(), via_proxy.tolist())
    if rank == 1:
        out["chained"] = rpc.rpc_sync("w2", add_then_double, args=("w0", 3, 4))
        out["timer"] = rpc.rpc_sync("w0", answered_by_a_timer, args=(torch.ones(2),)).tolist()
        with pytest.raises(KeyError, match="missing later"):
            rpc.rpc_sync("w2", fails_later)
        with pytest.raises(TypeError, match="must return a future"):
            rpc.rpc_sync("w2", forgets_the_future)
        futures = [rpc.rpc_async(f"w{r}", add, args=(r, 10)) for r in range(world)]
        out["wait_all"] = torch.futures.wait_all(futures)
        out["collect_all"] = [f.wait() for f in torch.futures.collect_all(futures).wait()]
        out["is_torch_future"] = isinstance(futures[0], torch.futures.Future)
    rpc.shutdown()
    return out


_servers: list[rpc.RRef] = []
_servers_lock = threading.Lock()


def shared_server() -> rpc.RRef:
    """One BatchingServer on this worker, made by whichever caller comes first."""
    with _servers_lock:
        if not _servers:
            _servers.append(rpc.RRef(BatchingServer(2)))
        return _servers[0]


def test_async_execution_answers_when_its_future_completes_and_futures_are_torch_futures() -> None:
    out = run_ranks(_async_calls, 3, backend=None, timeout=60)
    assert out[1]["batched"] == out[2]["batched"] == ([3.0] * 3, [30.0] * 3)
    assert out[1]["chained"] == 14
    assert out[1]["timer"] == [2.0, 2.0]
    assert out[1]["wait_all"] == out[1]["collect_all"] == [10, 11, 12]
    assert out[1]["is_torch_future"]


def test_gpu_device_maps_are_refused_with_a_clear_message() -> None:
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4)
    options.rpc_timeout = 5.0  # settable after construction, as TensorPipe's are
    options.set_device_map("worker1", {0: 1})
    with pytest.raises(ValueError, match=r"CPU tensors only.*tensor\.cpu\(\)"):
        rpc.init_rpc("w0", rank=0, world_size=1, rpc_backend_options=options)
    with pytest.raises(ValueError, match="cannot carry shoal's calls"):
        rpc.init_rpc("w0", backend="PROCESS_GROUP", rank=0, world_size=1)


def test_the_backend_registry_takes_torch_s_registrations_and_init_rpc_runs_shoal_s_agent_only() -> None:
    from shoal.rpc import backend_registry

    options = backend_registry.construct_rpc_backend_options(rpc.BackendType.TENSORPIPE, rpc_timeout=7.0,
                                                            num_worker_threads=3)
    assert isinstance(options, rpc.TensorPipeRpcBackendOptions) and (options.rpc_timeout, options.num_worker_threads) \
        == (7.0, 3)
    made = []
    custom = backend_registry.register_backend("CUSTOM_FOR_TEST", lambda timeout, method, **kw: made.append(timeout),
                                               lambda *a, **kw: None)
    assert custom is rpc.BackendType.CUSTOM_FOR_TEST and backend_registry.backend_registered("CUSTOM_FOR_TEST")
    backend_registry.construct_rpc_backend_options(custom, rpc_timeout=2.0)
    assert made == [2.0]
    with pytest.raises(RuntimeError, match="already registered"):
        backend_registry.register_backend("CUSTOM_FOR_TEST", print, print)
    with pytest.raises(ValueError, match="cannot carry shoal's calls"):
        rpc.init_rpc("w0", backend=custom, rank=0, world_size=1)
    assert rpc.is_available() and rpc.BackendType.TENSORPIPE.name == "TENSORPIPE"


@rpc.functions.async_execution
def answered_through_then(value: int) -> torch.futures.Future:
    """torch's then() returns a bare torch._C.Future, which must do as well."""
    future: torch.futures.Future = torch.futures.Future()
    chained = future.then(lambda done: done.value() * 3)
    future.set_result(value)
    return chained


def _then_future(rank: int, world: int) -> int | None:
    return rpc.rpc_sync("w1", answered_through_then, args=(5,)) if rank == 0 else None


def test_an_async_function_may_return_the_future_that_torch_then_makes() -> None:
    assert run_rpc_ranks(_then_future, 2, options={"rpc_timeout": RPC_TIMEOUT}, timeout=60)[0] == 15


_noticed: list = []
_noticed_lock = threading.Lock()


def note(value) -> None:
    with _noticed_lock:
        _noticed.append(value)
    if value == "fail":
        raise ValueError("a notice that fails is logged where it ran")


def noticed() -> list:
    with _noticed_lock:
        return list(_noticed)


def _notices(rank: int, world: int) -> list | None:
    from shoal.rpc.current import current_agent

    out = None
    if rank == 0:
        agent = current_agent()
        for value in ("fail", 1, torch.ones(2)):
            agent.notify("w1", note, (value,))
        # Notices are not answered: poll for their effect.
        wait_until(lambda: len(rpc.rpc_sync("w1", noticed)) >= 3, "w1 has run all three notices", timeout=20)
        out = rpc.rpc_sync("w1", noticed)
    return out


def test_a_notice_runs_on_the_callee_unanswered_and_a_failing_one_does_not_stop_the_others() -> None:
    got = run_rpc_ranks(_notices, 2, options={"rpc_timeout": RPC_TIMEOUT}, timeout=60)[0]
    assert sorted(map(str, got)) == sorted(["fail", "1", str(torch.ones(2))])
