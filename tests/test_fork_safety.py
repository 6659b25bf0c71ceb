"""shoal in forked processes. From a parent that ran parallel torch ops, at torch's default threads:
OpenMP's threads for a forked process's main thread are the parent's, which the child lacks, so work
shoal does on a worker's behalf runs on threads started in the child, as torch's does. And objects made
before a fork, which the child holds without their threads: those that can start their own do, the
others (process groups, RPC, a checkpoint writer) refuse with the remedy, and the parent's go on."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tests.ranks import run_ranks
from tests.scripts import fork_parameter_server as program

ROOT = Path(__file__).resolve().parents[1]


def _replay() -> list[float]:
    """The trainer's steps in one process, without RPC: the same model, data and optimizer."""
    server, local = program.Server(), program.embedding()
    optimizer = torch.optim.SGD([*server.layer.parameters(), *local.parameters()], lr=program.LR)
    losses = []
    for indices in program.trainer_batches():
        optimizer.zero_grad()
        features = local(indices)
        loss = server.forward(features).sum() + features.sum()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_a_parameter_server_forked_after_a_parallel_op_trains_ten_rounds_in_a_row() -> None:
    env = {name: value for name, value in os.environ.items() if not name.endswith("_NUM_THREADS")}
    result = subprocess.run([sys.executable, "-m", "tests.scripts.fork_parameter_server", "--rounds", "10"],
                            capture_output=True, text=True, timeout=20 * program.DEADLINE_S, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    rounds = [line.split(": losses ")[1] for line in result.stdout.splitlines() if ": losses " in line]
    assert len(rounds) == 10, result.stdout
    want = _replay()
    for losses in rounds:
        torch.testing.assert_close([float(loss) for loss in losses.split()], want)


def _in_child(checks: Callable[[], dict]) -> dict:
    """`checks()` in a child forked from this process, within 30 s; what it returned, or what it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 0
        try:
            signal.alarm(30)  # a hang ends the child, and the test with it
            os.close(read)
            try:
                result = checks()
            except BaseException as exc:
                result = {"raised": repr(exc)}
            os.write(write, pickle.dumps(result))
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        payload = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and payload, f"the child ended with status {status}"
    return pickle.loads(payload)


def _refused(call: Callable[[], object]) -> str:
    try:
        call()
    except RuntimeError as exc:
        return str(exc)
    return "not refused"


def _group_across_a_fork(rank: int, world: int) -> dict:
    import torch.distributed as tdist

    import shoal.distributed as dist
    from shoal.ports import free_port

    group = dist.group.WORLD
    seen = {}
    if rank == 0:
        def checks() -> dict:
            refused = _refused(lambda: dist.all_reduce(torch.ones(3), group=group))
            group.shutdown()  # the parent's links: left alone
            dist.destroy_process_group()
            out = {"refused": refused, "initialized": dist.is_initialized()}
            # a world of its own, each API's: torch's default group lent by the parent's init is taken back
            tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
            tensor = torch.ones(2)
            tdist.all_reduce(tensor)
            tdist.destroy_process_group()
            dist.init_process_group("shoal", f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
            tdist.all_reduce(tensor)  # torch's default group: lent by this process's own shoal world
            dist.all_reduce(tensor)
            dist.destroy_process_group()
            out["own worlds"] = tensor.tolist()
            return out
        seen = _in_child(checks)
    tensor = torch.full((3,), float(rank + 1))
    dist.all_reduce(tensor)  # the parent's group, after its child's tries
    seen["after"] = tensor.tolist()
    return seen


def test_a_process_group_made_before_a_fork_refuses_in_the_child_and_the_parent_goes_on() -> None:
    out = run_ranks(_group_across_a_fork, 2, timeout=90)
    assert out[1] == {"after": [3.0] * 3}
    assert out[0]["after"] == [3.0] * 3 and out[0]["initialized"] is False and out[0]["own worlds"] == [1.0] * 2
    assert "this process group was made in process" in out[0]["refused"]
    assert "call init_process_group in this process, or start this process with 'spawn'" in out[0]["refused"]


def _objects_across_a_fork(rank: int, world: int, port: int, directory: str) -> dict:
    from shoal import rpc
    from shoal.checkpoint import CheckpointManager
    from shoal.parallel import DataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc("worker0", rank=0, world_size=1)
    torch.manual_seed(0)
    model = DataParallel(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).double(), replicas=2)
    x = torch.randn(8, 6, dtype=torch.float64)
    model(x).sum().backward()  # the replica threads start here, in the parent
    manager = CheckpointManager(directory, async_save=True, rank=0)

    def checks() -> dict:
        model.zero_grad()
        model(x).sum().backward()  # on replica threads of the child's own
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model.module(x).sum().backward()
        return {"data parallel": all(torch.allclose(a, p.grad) for a, p in zip(got, model.parameters(), strict=True)),
                "checkpoint": _refused(lambda: manager.save(1, {"w": torch.ones(1)})),
                "rpc": _refused(lambda: rpc.rpc_sync("worker0", torch.add, args=(1, 1)))}

    seen = _in_child(checks)
    seen["parent rpc"] = rpc.rpc_sync("worker0", torch.add, args=(torch.ones(1), 1)).item()
    rpc.shutdown()
    return seen


def test_objects_made_before_a_fork_start_their_own_threads_in_the_child_or_refuse(tmp_path: Path) -> None:
    seen = run_ranks(_objects_across_a_fork, 1, str(tmp_path), backend=None, timeout=90)[0]
    assert seen["data parallel"] is True
    assert "this CheckpointManager was made in process" in seen["checkpoint"]
    assert "make one in this process" in seen["checkpoint"]
    assert "the RPC agent was made in process" in seen["rpc"]
    assert "call shoal.rpc.init_rpc() in this process" in seen["rpc"]
    assert seen["parent rpc"] == 2.0
