"""Start a benchmark's ranks as spawned processes and collect rank 0's result, failing fast if one dies."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(target: Callable, world_size: int, *args: Any) -> Any:
    """Call `target(rank, *args, results)` on `world_size` processes; return what rank 0 puts in `results`."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        while True:
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    code = procs[failed[0]].exitcode
                    raise RuntimeError(f"benchmark rank {failed[0]} exited with code {code}") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
