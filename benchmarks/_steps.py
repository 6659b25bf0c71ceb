"""A timed SGD training step, the same in every benchmark that compares step times."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
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


def train_steps(model: Any, batch: tuple[Any, Any], steps: int, barrier: Callable[[], Any] = lambda: None) -> StepTimes:
    """Time `steps` steps of zero_grad, forward, cross-entropy, backward and SGD, after a warm-up;
    `barrier` runs before each step, so that ranks start their steps together."""
    import torch
    from torch import nn

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for i in range(WARMUP + steps):
        if i == WARMUP:
            cpu, wall = time.process_time(), time.perf_counter()
        barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return StepTimes(median=statistics.median(times[WARMUP:]), cpu=time.process_time() - cpu,
                     wall=time.perf_counter() - wall)
