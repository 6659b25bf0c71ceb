"""Distributed autograd between real worker processes: gradients equal local autograd on the
unsplit computation (float64), contexts stay apart and are released everywhere, and failures in
a remote backward reach the caller."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from shoal import autograd as dist_autograd
from shoal import rpc
from shoal.errors import PeerFailure
from shoal.ports import free_port
from shoal.rpc.autograd_contexts import contexts
from tests.ranks import run_ranks, run_rpc_ranks
from tests.waiting import wait_until

TOL = {"rtol": 1e-12, "atol": 1e-12}


def _init(rank: int, world: int, port: int) -> None:
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=30.0, init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=options)


# ---- parameters every worker can rebuild: the reference computation needs the same values -------

def initial(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


_params: dict[str, torch.Tensor] = {}
_params_lock = threading.Lock()


def param(name: str, shape: tuple[int, ...] = (4, 4)) -> torch.Tensor:
    """This worker's parameter `name` (created on first use, by one of the calls that race to)."""
    with _params_lock:
        if name not in _params:
            _params[name] = initial(name, shape).requires_grad_()
        return _params[name]


def grad_of(context_id: int, name: str) -> torch.Tensor | None:
    return dist_autograd.get_gradients(context_id).get(param(name))


def live_contexts() -> int:
    return len(contexts)


def contexts_left(workers: list[str], seconds: float = 20.0) -> list[int]:
    """How many contexts each worker holds once releases have arrived: they travel as notices that
    nobody waits for, so this polls until none is left; it raises, naming the counts, if time is up."""
    left: list[int] = []

    def released() -> bool:
        left[:] = [rpc.rpc_sync(worker, live_contexts) for worker in workers]
        return not any(left)

    try:
        wait_until(released, f"{', '.join(workers)} hold no context", timeout=seconds)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; they hold {left}") from None
    return left


# ---- the remote pieces of the computations ------------------------------------------------------

def stage_c(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ param("C"))


def stage_b(x: torch.Tensor) -> torch.Tensor:
    h = torch.sigmoid(x @ param("B"))
    return rpc.rpc_sync("w2", stage_c, args=(h,)) * h  # nested, and h is used on both sides


def branch(h: torch.Tensor, name: str) -> torch.Tensor:
    return torch.sin(h @ param(name))


def two_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x @ param("B"), torch.exp(x @ param("B2"))


class Activation:
    def __init__(self, x: torch.Tensor) -> None:
        self.value = torch.tanh(x @ param("B"))

    def get(self) -> torch.Tensor:
        return self.value


def activation_of(x: torch.Tensor) -> torch.Tensor:
    return Activation(x).value


# ---- gradients equal local autograd ----------------------------------------------------------------

def _x() -> torch.Tensor:
    return initial("x", (3, 4)).requires_grad_()


def _scenarios(rank: int, world: int) -> dict:
    out: dict = {}
    if rank == 0:
        ref = {name: initial(name, (4, 4)).requires_grad_() for name in ("A", "B", "B2", "C", "D")}

        # A chain w0 -> w1 -> w2 with a nested call; h is used on w1 and on w2.
        x = _x()
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("w1", stage_b, args=(x @ param("A"),))
            dist_autograd.backward(cid, [(y ** 2).sum()])
            got = [dist_autograd.get_gradients(cid)[x], grad_of(cid, "A"),
                   rpc.rpc_sync("w1", grad_of, args=(cid, "B")), rpc.rpc_sync("w2", grad_of, args=(cid, "C"))]
            assert x.grad is None and param("A").grad is None  # never .grad
        xr = _x()
        hr = torch.sigmoid((xr @ ref["A"]) @ ref["B"])
        yr = torch.tanh(hr @ ref["C"]) * hr
        out["chain"] = (got, list(torch.autograd.grad((yr ** 2).sum(), [xr, ref["A"], ref["B"], ref["C"]])))

        # A diamond: h goes to w1 and to w2 and is also used here.
        x = _x()
        with dist_autograd.context() as cid:
            h = x @ param("A")
            f1, f2 = rpc.rpc_async("w1", branch, args=(h, "B")), rpc.rpc_async("w2", branch, args=(h, "C"))
            loss = (f1.wait() * f2.wait()).sum() + h.sum()
            dist_autograd.backward(cid, [loss])
            got = [dist_autograd.get_gradients(cid)[x], grad_of(cid, "A"),
                   rpc.rpc_sync("w1", grad_of, args=(cid, "B")), rpc.rpc_sync("w2", grad_of, args=(cid, "C"))]
        xr = _x()
        hr = xr @ ref["A"]
        loss = (torch.sin(hr @ ref["B"]) * torch.sin(hr @ ref["C"])).sum() + hr.sum()
        out["diamond"] = (got, list(torch.autograd.grad(loss, [xr, ref["A"], ref["B"], ref["C"]])))

        # remote() keeps the activation on w1; to_here() brings it into the graph here.
        x = _x()
        with dist_autograd.context() as cid:
            activation = rpc.remote("w1", activation_of, args=(x,))
            dist_autograd.backward(cid, [activation.to_here().pow(3).sum()])
            got = [dist_autograd.get_gradients(cid)[x], rpc.rpc_sync("w1", grad_of, args=(cid, "B"))]
        xr = _x()
        out["to_here"] = (got, list(torch.autograd.grad(torch.tanh(xr @ ref["B"]).pow(3).sum(), [xr, ref["B"]])))

        # The same through an RRef's proxy: a method of an object that lives on w1.
        x = _x()
        with dist_autograd.context() as cid:
            holder = rpc.remote("w1", Activation, args=(x,))
            value = holder.rpc_sync().get()
            dist_autograd.backward(cid, [value.sum()])
            got = [dist_autograd.get_gradients(cid)[x], rpc.rpc_sync("w1", grad_of, args=(cid, "B"))]
        xr = _x()
        out["proxy"] = (got, list(torch.autograd.grad(torch.tanh(xr @ ref["B"]).sum(), [xr, ref["B"]])))

        # A received tensor passed on unchanged (to a third worker, and back to its maker) and also
        # used here: its gradients go straight to w1, which made it, from each place.
        x = _x()
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("w1", branch, args=(x, "B"))
            there = rpc.rpc_sync("w2", branch, args=(y, "C"))
            back = rpc.rpc_sync("w1", branch, args=(y, "D"))
            dist_autograd.backward(cid, [(there * back).sum() + y.pow(2).sum()])
            got = [dist_autograd.get_gradients(cid)[x], rpc.rpc_sync("w1", grad_of, args=(cid, "B")),
                   rpc.rpc_sync("w2", grad_of, args=(cid, "C")), rpc.rpc_sync("w1", grad_of, args=(cid, "D"))]
        xr = _x()
        yr = torch.sin(xr @ ref["B"])
        loss = (torch.sin(yr @ ref["C"]) * torch.sin(yr @ ref["D"])).sum() + yr.pow(2).sum()
        out["forwarded"] = (got, list(torch.autograd.grad(loss, [xr, ref["B"], ref["C"], ref["D"]])))

        # Outputs that never reach the loss: one of two results, and a whole call's result.
        x = _x()
        with dist_autograd.context() as cid:
            used, unused = rpc.rpc_sync("w1", two_outputs, args=(x,))
            ignored = rpc.rpc_sync("w2", branch, args=(x, "C"))
            dist_autograd.backward(cid, [used.sum()])
            got = [dist_autograd.get_gradients(cid)[x], rpc.rpc_sync("w1", grad_of, args=(cid, "B")),
                   rpc.rpc_sync("w1", grad_of, args=(cid, "B2")), rpc.rpc_sync("w2", grad_of, args=(cid, "C"))]
            assert unused.requires_grad and ignored.requires_grad
        xr = _x()
        expected = list(torch.autograd.grad((xr @ ref["B"]).sum(), [xr, ref["B"]]))
        out["unused"] = (got[:2], expected, got[2:])
    return out


@pytest.fixture(scope="module")
def scenarios() -> dict:
    return run_rpc_ranks(_scenarios, 3, timeout=90)[0]


@pytest.mark.parametrize("case", ["chain", "diamond", "to_here", "proxy", "forwarded"])
def test_gradients_equal_local_autograd(scenarios: dict, case: str) -> None:
    got, expected = scenarios[case]
    assert len(got) == len(expected)
    for index, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g is not None, f"{case}: gradient {index} is missing"
        torch.testing.assert_close(g, e, **TOL, msg=lambda m, i=index: f"{case}, gradient {i}: {m}")


def test_an_output_that_does_not_reach_the_loss_neither_hangs_nor_changes_gradients(scenarios: dict) -> None:
    got, expected, untouched = scenarios["unused"]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **TOL)
    assert untouched == [None, None]  # B2 and C got no gradient: nothing flowed to them


# ---- contexts stay apart and end everywhere ---------------------------------------------------------

def scaled_by_shared(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ param("P"))


def _concurrent_trainers(rank: int, world: int, port: int) -> dict:
    """w1 and w2 train against w0's parameter P at the same time, each in its own contexts."""
    _init(rank, world, port)
    out: dict = {}
    if rank > 0:
        mismatches = []
        for step in range(20):
            x = initial(f"x{rank}-{step}", (3, 4))
            with dist_autograd.context() as cid:
                loss = rpc.rpc_sync("w0", scaled_by_shared, args=(x,)).sum() * rank
                dist_autograd.backward(cid, [loss])
                got = rpc.rpc_sync("w0", grad_of, args=(cid, "P"))
            p = initial("P", (4, 4)).requires_grad_()
            expected, = torch.autograd.grad((torch.tanh(x @ p).sum() * rank), [p])
            if not torch.allclose(got, expected, **{"rtol": 1e-12, "atol": 1e-12}):
                mismatches.append(step)
        out["mismatches"] = mismatches
    rpc.shutdown()
    if rank == 0:
        out["p_grad"] = param("P").grad  # never written: gradients live in the contexts
    return out


def test_concurrent_contexts_over_shared_parameters_stay_apart() -> None:
    out = run_ranks(_concurrent_trainers, 3, backend=None, timeout=90)
    assert out[1]["mismatches"] == [] and out[2]["mismatches"] == []
    assert out[0]["p_grad"] is None


def _many_contexts(rank: int, world: int) -> list[int] | None:
    left = None
    if rank == 0:
        for step in range(1000):
            x = _x()
            with dist_autograd.context() as cid:
                h = rpc.rpc_sync("w1", branch, args=(x, "B"))
                y = rpc.rpc_sync("w2", stage_c, args=(h,)) if step % 2 else h
                dist_autograd.backward(cid, [y.sum()])
        left = contexts_left(["w0", "w1", "w2"])
    return left


def test_after_a_thousand_contexts_none_is_alive_on_any_worker() -> None:
    assert run_rpc_ranks(_many_contexts, 3, timeout=120)[0] == [0, 0, 0]


# ---- failures ----------------------------------------------------------------------------------------

_originator_pid: list[int] = []


def _refuse() -> None:
    raise ValueError("backward refused on purpose")


# What a backward does on the worker that runs it: the faults the tests inject.
_FAULTS = {
    "fail": _refuse,
    "die": lambda: os.kill(os.getpid(), signal.SIGKILL),
    "kill the originator": lambda: os.kill(_originator_pid[0], signal.SIGKILL),
}


class FaultInBackward(torch.autograd.Function):
    """Doubles its input; its backward injects the fault named by `fault`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fault: str) -> torch.Tensor:
        ctx.fault = fault
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _FAULTS[ctx.fault]()
        return grad * 2, None


def fails_in_backward(x: torch.Tensor) -> torch.Tensor:
    return FaultInBackward.apply(x @ param("B"), "fail")


def dies_in_backward(x: torch.Tensor) -> torch.Tensor:
    return FaultInBackward.apply(x @ param("B"), "die")


def _remote_backward_error(rank: int, world: int) -> dict:
    out: dict = {}
    if rank == 0:
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("w1", fails_in_backward, args=(_x(),))
            try:
                dist_autograd.backward(cid, [y.sum()])
            except ValueError as exc:
                out["error"] = (type(exc).__name__, str(exc), str(exc.__cause__))
        out["alive"] = contexts_left(["w0", "w1"])
    return out


def test_an_error_in_a_remote_backward_reaches_the_caller_with_its_type_and_traceback() -> None:
    out = run_rpc_ranks(_remote_backward_error, 2, timeout=60)
    kind, message, remote_traceback = out[0]["error"]
    assert (kind, message) == ("ValueError", "backward refused on purpose")
    assert "on worker 'w1'" in remote_traceback and "raise ValueError" in remote_traceback
    assert out[0]["alive"] == [0, 0]


def _callee_dies_mid_backward(rank: int, world: int) -> dict:
    """w1 returns at once and is killed in its shutdown, serving w0's backward."""
    out: dict = {}
    if rank == 0:
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("w1", dies_in_backward, args=(_x(),))
            z = rpc.rpc_sync("w2", branch, args=(_x(), "C"))
            with pytest.raises(PeerFailure) as failure:
                dist_autograd.backward(cid, [(y.sum() + z.sum())])
            out["failed_rank"] = failure.value.rank
        out["alive"] = contexts_left(["w0", "w2"])
    return out


def test_a_worker_dying_mid_backward_is_raised_as_peer_failure_naming_it() -> None:
    out = run_rpc_ranks(_callee_dies_mid_backward, 3, timeout=60, expect={1: "dies"})
    assert out[0] == {"failed_rank": 1, "alive": [0, 0]}


_in_backward, _released = threading.Event(), threading.Event()


class WaitsInBackward(torch.autograd.Function):
    """Doubles; its backward waits until `_released` (the test has lost a peer meanwhile)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        _in_backward.set()
        assert _released.wait(timeout=30)
        return grad * 2


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _local_backward_while_a_peer_dies(rank: int, world: int) -> list[float] | None:
    """w0 runs a backward that touches no other worker; w1 dies during it, and w0 hears of it."""
    if rank == 1:
        return None  # serves, until w0 asks it to die
    rpc.api.current_agent().on_worker_lost(lambda worker: _released.set())  # after the backwards are told

    def kill_w1() -> None:
        assert _in_backward.wait(timeout=30)
        rpc.rpc_async("w1", _kill_self)  # answered by its death

    threading.Thread(target=kill_w1, daemon=True).start()
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [WaitsInBackward.apply(x).sum()])
        return dist_autograd.get_gradients(cid)[x].tolist()


def test_a_backward_that_touches_no_other_worker_outlives_a_peers_death() -> None:
    """Only backwards whose context reached other workers can depend on the dead one."""
    out = run_rpc_ranks(_local_backward_while_a_peer_dies, 2, timeout=60, expect={1: "dies"})
    assert out[0] == [2.0, 2.0, 2.0]


def remember_originator(pid: int) -> None:
    _originator_pid.append(pid)


def kills_originator_in_backward(x: torch.Tensor) -> torch.Tensor:
    return FaultInBackward.apply(x @ param("B"), "kill the originator")


def _originator_dies_mid_backward(rank: int, world: int) -> dict:
    """w2 starts a backward through w1 and w0 and is killed while w1's part runs; the survivors
    release w2's contexts on their own."""
    if rank == 2:
        rpc.rpc_sync("w1", remember_originator, args=(os.getpid(),))
        with dist_autograd.context() as cid:
            h = rpc.rpc_sync("w0", branch, args=(_x(), "A"))
            y = rpc.rpc_sync("w1", kills_originator_in_backward, args=(h,))
            dist_autograd.backward(cid, [y.sum()])
        return {}
    # Wait until w2 has used this worker in a context and then died, which ends that context here.
    wait_until(lambda: rpc.api.current_agent().is_lost("w2") and not len(contexts),
               f"w2 is lost and w{rank} holds none of its contexts", timeout=30)
    return {"alive": len(contexts)}


def test_the_contexts_of_an_originator_killed_mid_backward_are_released_by_the_others() -> None:
    out = run_rpc_ranks(_originator_dies_mid_backward, 3, timeout=60, expect={2: "dies"})
    assert out[0] == out[1] == {"alive": 0}


# ---- DistributedDataParallel inside a context -------------------------------------------------------

def _ddp_in_context(rank: int, world: int, group_port: int) -> dict | None:
    """w1 and w2 wrap a local layer in DDP (a process group of their own) after a layer on w0; a
    distributed backward leaves the layer's gradients in each context averaged over both."""
    import shoal.distributed as dist
    from shoal.nn import RemoteModule
    from shoal.parallel import DistributedDataParallel

    out = None
    if rank > 0:
        dist.init_process_group("shoal", f"tcp://127.0.0.1:{group_port}", rank=rank - 1, world_size=2)
        remote = RemoteModule("w0/cpu", torch.nn.Linear, args=(4, 4), kwargs={"dtype": torch.float64})
        torch.manual_seed(0)
        local = torch.nn.Linear(4, 3, dtype=torch.float64)
        replica = DistributedDataParallel(local)
        x = initial(f"x{rank}", (5, 4))
        with dist_autograd.context() as cid:
            h = remote(x)
            loss = replica(h).pow(2).sum() * rank  # the trainers' gradients differ
            dist_autograd.backward(cid, [loss])
            got = [dist_autograd.get_gradients(cid)[p] for p in local.parameters()]
        mine = torch.autograd.grad(local(h.detach()).pow(2).sum() * rank, list(local.parameters()))
        theirs = [torch.zeros_like(g) for g in mine]
        for g, t in zip(mine, theirs, strict=True):
            dist.all_reduce(t.copy_(g))
        out = {"in context": got, "averaged": [t / 2 for t in theirs], "mine": list(mine),
               "weight.grad": local.weight.grad}
        dist.destroy_process_group()
    return out


def test_ddp_inside_a_context_averages_its_gradients_in_the_context() -> None:
    out = run_rpc_ranks(_ddp_in_context, 3, free_port(), timeout=90)
    for rank in (1, 2):
        torch.testing.assert_close(out[rank]["in context"], out[rank]["averaged"], **TOL,
                                   msg=lambda m, rank=rank: f"w{rank}'s gradients in the context: {m}")
        assert out[rank]["weight.grad"] is None  # the context holds them, not .grad
        # The trainers' own gradients differ, else averaging would prove nothing.
        assert not torch.allclose(out[rank]["mine"][0], out[rank]["averaged"][0]), out[rank]


# ---- every worker a context reached is told when it ends ---------------------------------------------

def relay_through(name: str, x: torch.Tensor) -> float:
    """Called with a tensor that needs no grad: the call joins the context all the same, and its
    own call to `name` records a send there."""
    return rpc.rpc_sync(name, branch, args=(x @ param("A"), "C")).sum().item()


def slow_output(x: torch.Tensor) -> torch.Tensor:
    time.sleep(0.5)  # the remote work itself: its answer arrives after the caller's context ended
    return x @ param("B")


def _contexts_end_everywhere(rank: int, world: int) -> dict:
    out: dict = {}
    if rank == 0:
        with dist_autograd.context():
            out["relayed"] = rpc.rpc_sync("w1", relay_through, args=("w2", initial("x", (3, 4))))
        with dist_autograd.context():
            late = rpc.rpc_async("w1", slow_output, args=(_x(),))
        try:
            late.wait()
        except RuntimeError as exc:
            out["late"] = str(exc)
        out["left"] = contexts_left(["w0", "w1", "w2"])
    return out


def test_contexts_end_on_workers_reached_without_grad_tensors_and_do_not_come_back_late() -> None:
    out = run_rpc_ranks(_contexts_end_everywhere, 3, timeout=60)[0]
    assert isinstance(out["relayed"], float)
    assert "released here already" in out["late"]
    assert out["left"] == [0, 0, 0]
