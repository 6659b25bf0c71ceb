"""Start a benchmark's ranks as spawned processes and collect rank 0's result, failing fast if one dies."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from typing import Any


def run(target: Callable, world_size: int, *args: Any, timeout: float | None = None) -> Any:
    """Call `target(rank, *args, results)` on `world_size` processes; return what rank 0 puts in `results`.

    Raises if a rank dies first, or (with `timeout`) if no result comes within that many seconds.
    After a result the ranks get a minute to finish on their own; after a failure, none. Every
    process started here is gone when it returns."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, results)) for r in range(world_size)]
    deadline = None if timeout is None else time.monotonic() + timeout
    finished = False
    for p in procs:
        p.start()
    try:
        while True:
            try:
                result = results.get(timeout=1.0)
                finished = True
                return result
            except queue.Empty:
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    code = procs[failed[0]].exitcode
                    raise RuntimeError(f"benchmark rank {failed[0]} exited with code {code}") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"benchmark: no result within {timeout:g} s") from None
    finally:
        grace_ends = time.monotonic() + (60 if finished else 0)
        for p in procs:
            p.join(timeout=max(0.0, grace_ends - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
