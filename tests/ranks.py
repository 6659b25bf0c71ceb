"""Spawn real ranks on 127.0.0.1 with a deadline and guaranteed cleanup: the one way tests and benchmarks do it.

    out = run_ranks(fn, 3)                  # fn(rank, world_size) inside a "shoal" process group, 3 processes
    out = run_ranks(fn, 2, backend=None)    # fn(rank, world_size, port) sets itself up on a free port
    out = run_rpc_ranks(fn, 3)              # fn(rank, world_size) as RPC worker w{rank}

Each returns {rank: what fn returned there}. The processes are shoal.multiprocessing's (`start_processes`):
they die with the process that started them, and a rank that raises leaves its traceback, re-raised here
as RankFailed with the rank in the message. On top of that, this module collects each rank's result, keeps
a deadline, lets a test kill ranks on purpose (`expect={rank: "dies"}`), and kills every process it
started before it returns.

Benchmarks import it too (`from tests.ranks import run_ranks`): run as scripts or through `shoal bench`,
they put the repository's root on sys.path.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from shoal.multiprocessing import (
    ProcessContext,
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    start_processes,
)
from shoal.ports import free_port

_POLL_S = 0.2  # how often the ranks' processes are looked at while no result arrives
_EXIT_GRACE_S = 10.0  # how long ranks that have returned get to exit before they are killed
_RPC_TIMEOUT_S = 30.0  # a hung call fails within run_rpc_ranks' default deadline, naming the call


class RankFailed(AssertionError):
    """A spawned rank raised, or ended without returning; the message holds its rank (and its traceback)."""


def _rank_main(_index: int, rank: int, fn: Callable, world_size: int, port: int, backend: str | None,
               group_timeout: float, env: dict[str, str], args: tuple, results: Any) -> None:
    """One rank's process. start_processes calls it with its index among the processes of one call, always
    0: each rank is started by a call of its own, so that a rank killed on purpose stops no other."""
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    import shoal.distributed as dist

    try:
        if backend is not None:
            dist.init_process_group(backend, f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=group_timeout))
            out = fn(rank, world_size, *args)
        else:
            out = fn(rank, world_size, port, *args)
        # Plain pickle: the queue's own pickler would pass tensors as file descriptors of shared memory,
        # which vanish when this process exits before the parent reads them.
        results.put((rank, pickle.dumps(out)))
    except (Exception, SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        # pytest's outcomes (a pytest.raises that saw nothing, pytest.fail) are no Exceptions, and
        # start_processes records only those: raised again as one, with the original chained to it.
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _failure(rank: int, exc: ProcessException) -> RankFailed:
    if isinstance(exc, ProcessRaisedException):
        trace = exc.msg.partition(" raised:\n")[2] or exc.msg
        summary = trace.strip().splitlines()[-1]  # the exception's own line, first, where pytest shows it
        return RankFailed(f"rank {rank} (pid {exc.pid}) failed: {summary}\n{trace}")
    assert isinstance(exc, ProcessExitedException), exc
    how = f"was killed by {exc.signal_name}" if exc.signal_name else f"exited with code {exc.exit_code}"
    return RankFailed(f"rank {rank} (pid {exc.pid}) {how} without returning a result")


def _collect(ranks: dict[int, ProcessContext], results: Any, dying: set[int], deadline: float | None,
             timeout: float | None, outcomes: dict[int, Any]) -> None:
    """Fill `outcomes` with every rank's result but the dying ones'; raise at the first rank that fails."""
    waiting = set(ranks) - dying
    watched = set(ranks)  # ranks whose end is still news: not yet returned, and not yet seen to end
    ended = set()  # ranks whose process exited cleanly: their result, if they sent one, is in the queue
    while waiting:
        try:
            rank, payload = results.get(timeout=_POLL_S)
        except queue.Empty:
            pass
        else:
            outcomes[rank] = pickle.loads(payload)
            waiting.discard(rank)
            watched.discard(rank)  # an end after returning (its process group's teardown, say) is not checked
            continue
        silent = sorted(ended & waiting)
        if silent:
            raise RankFailed(f"rank {silent[0]} exited with code 0 without returning a result")
        for rank in sorted(watched):
            try:
                if ranks[rank].join(timeout=0):
                    ended.add(rank)
                    watched.discard(rank)
            except ProcessException as exc:
                watched.discard(rank)
                if rank not in dying or isinstance(exc, ProcessRaisedException):
                    raise _failure(rank, exc) from None
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"ranks {sorted(waiting)} did not finish within {timeout:g}s")


def _stop(ranks: dict[int, ProcessContext], returned: set[int]) -> None:
    """Give the ranks in `returned` a moment to exit, kill every other process, and reap them all."""
    grace_ends = time.monotonic() + _EXIT_GRACE_S
    for rank, context in ranks.items():
        for process in context.processes:
            if rank in returned:
                process.join(max(0.0, grace_ends - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5)
        try:
            context.join(timeout=0)  # reaps the process and removes the context's files
        except ProcessException:
            pass  # the failure was raised already, or came after the rank returned (not checked, see above)


def run_ranks(fn: Callable, world_size: int, *args: Any, backend: str | None = "shoal", timeout: float | None = 60,
              group_timeout: float = 60, env: dict[str, str] | None = None,
              expect: dict[int, str] | None = None) -> dict[int, Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh processes, each inside an initialized
    process group of `backend` (with backend=None, `fn(rank, world_size, port, *args)` sets up itself,
    `port` a free one), and return {rank: result}. `env` is set in each process before `fn` runs.

    Raises RankFailed as soon as a rank raises (its traceback in the message) or ends without returning,
    and TimeoutError if the ranks have not all returned within `timeout` seconds (None: no deadline, for
    benchmarks whose arguments set their length). `expect` maps ranks the test kills on purpose to
    "dies": they are not waited for, and their end is no failure (a traceback from them still is).
    Every process started here is gone when this returns or raises.
    """
    expect = expect or {}
    unknown = {rank: what for rank, what in expect.items() if what != "dies"}
    if unknown:
        raise ValueError(f"expect maps ranks to 'dies' (killed on purpose), got {unknown}")
    results = multiprocessing.get_context("spawn").Queue()
    port = free_port()
    deadline = None if timeout is None else time.monotonic() + timeout
    ranks: dict[int, ProcessContext] = {}
    outcomes: dict[int, Any] = {}
    returned: set[int] = set()
    try:
        for rank in range(world_size):
            ranks[rank] = start_processes(_rank_main, args=(rank, fn, world_size, port, backend, group_timeout,
                                                            env or {}, args, results), join=False, daemon=True)
        _collect(ranks, results, set(expect), deadline, timeout, outcomes)
        returned = set(outcomes)
    finally:
        _stop(ranks, returned)
    return outcomes


def _rpc_worker(rank: int, world_size: int, port: int, fn: Callable, names: Sequence[str] | None,
                options: dict[str, Any], *args: Any) -> Any:
    from shoal import rpc

    name = f"w{rank}" if names is None else names[rank]
    rpc.init_rpc(name, rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", **options))
    out = fn(rank, world_size, *args)
    rpc.shutdown()  # graceful: it waits for the other workers' calls to this one
    return out


def run_rpc_ranks(fn: Callable, world_size: int, *args: Any, names: Sequence[str] | None = None,
                  options: dict[str, Any] | None = None, timeout: float | None = 60,
                  env: dict[str, str] | None = None, expect: dict[int, str] | None = None) -> dict[int, Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh processes, each a worker of one RPC group,
    and return {rank: result}, as run_ranks does (the same deadline, failures, `env` and `expect`).

    Worker `rank` is named `names[rank]` (w0, w1, ... by default), meets the others on a free port, and
    shuts down gracefully once `fn` returns; one whose `fn` raises does not, as the run ends at once.
    `options` are RpcBackendOptions' fields (rpc_timeout 30 s unless given, within the default deadline).
    """
    if names is not None and len(names) != world_size:
        raise ValueError(f"names must name each of the {world_size} workers, got {list(names)}")
    options = {"rpc_timeout": _RPC_TIMEOUT_S, **(options or {})}
    return run_ranks(_rpc_worker, world_size, fn, names, options, *args, backend=None, timeout=timeout, env=env,
                     expect=expect)
