"""Spawn real ranks on 127.0.0.1 for multi-process tests, with a deadline and guaranteed cleanup.

A rank's exception is re-raised in the test with the rank in the message; a rank that neither
finishes nor fails within the deadline fails the test, and every process started is killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from shoal.ports import free_port


class RankFailed(AssertionError):
    """A spawned rank raised; the message holds its rank and traceback."""


def _entry(fn: Callable, rank: int, world_size: int, port: int, backend: str | None, group_timeout: float,
           env: dict[str, str], args: tuple, results: mp.Queue) -> None:
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    import shoal.distributed as dist

    try:
        if backend is not None:
            dist.init_process_group(backend, f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=group_timeout))
        out = fn(rank, world_size, *args) if backend is not None else fn(rank, world_size, port, *args)
        # Plain pickle: the queue's own pickler would pass tensors as file descriptors of shared memory,
        # which vanish when this process exits before the test reads them.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as exc:
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, backend: str | None = "shoal", timeout: float = 60,
              group_timeout: float = 60, env: dict[str, str] | None = None,
              expect: dict[int, str] | None = None) -> dict[int, Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh processes, each inside an initialized
    process group of `backend` (with backend=None, `fn(rank, world_size, port, *args)` sets up itself).

    Returns {rank: result}. `expect` maps ranks to "dies" for ranks the test kills on purpose.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, backend, group_timeout, env or {}, args,
                                              results), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    expect = expect or {}
    waiting = {r for r in range(world_size) if expect.get(r) != "dies"}
    outcomes: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while waiting:
            try:
                rank, status, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(waiting)} did not finish within {timeout}s") from None
                dead = [r for r in waiting if not procs[r].is_alive() and procs[r].exitcode not in (0, None)]
                if dead:
                    raise RankFailed(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                     f"without reporting") from None
                continue
            if status == "error":
                raise RankFailed(f"rank {rank} failed: {value}")
            outcomes[rank] = pickle.loads(value)
            waiting.discard(rank)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline + 10 - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return outcomes


def wait_gone(pid: int) -> None:
    """Raise ProcessLookupError once `pid` is gone (a zombie counts as gone); return if it lives on 10 s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    raise ProcessLookupError(pid)
        except FileNotFoundError:
            raise ProcessLookupError(pid) from None
        time.sleep(0.1)  # the process is on its way out; poll its state briefly
