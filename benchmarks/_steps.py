"""How benchmarks time what they compare: a training step, ops taken in turn, batches of communication ops."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

WARMUP = 3  # untimed first steps: they build buffers and caches


@dataclass(kw_only=True)
class StepTimes:
    median: float
    """The median step, in seconds."""
    cpu: float
    """Process CPU seconds (all threads) over the timed steps."""
    wall: float
    """Wall seconds over the timed steps."""


def training_step(model: Any, batch: tuple[Any, Any]) -> Callable[[], None]:
    """One step of zero_grad, forward, cross-entropy, backward and SGD on `model`, with its own optimizer."""
    import torch
    from torch import nn

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()
    return step


def train_steps(model: Any, batch: tuple[Any, Any], steps: int, barrier: Callable[[], Any] = lambda: None) -> StepTimes:
    """Time `steps` training steps after a warm-up; `barrier` runs before each step, so that ranks
    start their steps together."""
    step = training_step(model, batch)
    times = []
    for i in range(WARMUP + steps):
        if i == WARMUP:
            cpu, wall = time.process_time(), time.perf_counter()
        barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return StepTimes(median=statistics.median(times[WARMUP:]), cpu=time.process_time() - cpu,
                     wall=time.perf_counter() - wall)


def interleaved_times(ops: dict[str, Callable[[], Any]], steps: int,
                      barrier: Callable[[], Any] = lambda: None) -> dict[str, list[float]]:
    """The seconds of each of `steps` calls of each op after a warm-up, taking the ops in turn (one call
    of each per round) so that a machine whose speed drifts during the run slows them all alike; each
    round starts one op further on, so that none is always first. `barrier` runs before each call."""
    times: dict[str, list[float]] = {label: [] for label in ops}
    order = list(ops.items())
    for i in range(WARMUP + steps):
        for label, op in order[i % len(order):] + order[:i % len(order)]:
            barrier()
            start = time.perf_counter()
            op()
            if i >= WARMUP:
                times[label].append(time.perf_counter() - start)
    return times


def interleaved(ops: dict[str, Callable[[], Any]], steps: int,
                barrier: Callable[[], Any] = lambda: None) -> dict[str, float]:
    """The median seconds of each op, timed as `interleaved_times` does."""
    return {label: statistics.median(values) for label, values in interleaved_times(ops, steps, barrier).items()}


def batched(op: Callable[[], Any], nbytes: int) -> tuple[Callable[[], None], int]:
    """`op` run back to back, as many times as fill ~0.2 s at 1 GB/s (a communication op on `nbytes`), timed
    as one; and that count."""
    count = max(1, min(100, int(0.2 / max(nbytes / 1e9, 1e-4))))

    def batch() -> None:
        for _ in range(count):
            op()
    return batch, count


def slowest_call(ops: dict[str, Callable[[], Any]], nbytes: int, repeats: int,
                 barrier: Callable[[], Any]) -> dict[str, float]:
    """Seconds per call of each communication op on `nbytes`: batches of it (`batched`) timed in turn
    (`interleaved`) with the garbage collector paused (`collector_paused`), the median batch divided by its
    length, the slowest rank's (over torch.distributed's default group, which every rank must be in)."""
    import torch
    import torch.distributed as tdist

    batches = {label: batched(op, nbytes) for label, op in ops.items()}
    with collector_paused():
        medians = interleaved({label: batch for label, (batch, _) in batches.items()}, repeats, barrier)
    times = {}
    for label, (_, count) in batches.items():
        seconds = torch.tensor([medians[label] / count], dtype=torch.float64)
        tdist.all_reduce(seconds, op=tdist.ReduceOp.MAX)  # the slowest rank sets the pace
        times[label] = seconds.item()
    return times


@contextmanager
def collector_paused() -> Iterator[None]:
    """Time without Python's garbage collector, as `timeit` does: a full collection of a process that has
    imported torch takes 75-100 ms here, and lands on whichever op is running (all ranks wait for the rank
    collecting), however little that op allocates; collected once before."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
