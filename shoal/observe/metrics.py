"""Training metrics as JSON lines: one line per step with its time, loss, throughput, the time spent
computing and communicating, and the bytes communicated, for plotting or comparing runs.

    metrics = Metrics("metrics.jsonl")
    for x, y in loader:
        ...
        metrics.step(loss=loss, samples=len(x))

Compute and communication time come from the same spans as the timeline (events.py): forward,
backward and optimizer steps; collectives, sends, receives and RPC calls. Communication that runs on
the backend's thread during backward counts in both: `comm_s` beside `compute_s` shows how much was
there to hide. Every rank may write to the same file: each line is one append, and names its rank.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from shoal import config
from shoal.observe import events


class Metrics:
    """An events.Sink that sums this process's spans per step and appends a line at each `step()`."""

    def __init__(self, path: str | os.PathLike, rank: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank if rank is not None else config.RANK.get() or 0
        self.steps = 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()
        self._compute_ns = self._comm_ns = self._comm_bytes = 0
        self._since = time.perf_counter()
        events.attach(self)

    def step(self, *, loss: float | Any = None, samples: int | None = None, generation: int | None = None,
             **extra: Any) -> dict[str, Any]:
        """Close the step that began at the previous call (or at construction) and write its line;
        `loss` may be a tensor (read with .item()), `extra` adds fields. Returns the line's fields."""
        now = time.perf_counter()
        with self._lock:
            compute, comm, sent = self._compute_ns, self._comm_ns, self._comm_bytes
            self._compute_ns = self._comm_ns = self._comm_bytes = 0
        seconds, self._since = now - self._since, now
        self.steps += 1
        line: dict[str, Any] = {"step": self.steps, "rank": self.rank, "time": time.time(), "step_s": round(seconds, 6)}
        if loss is not None:
            line["loss"] = float(loss.item() if hasattr(loss, "item") else loss)
        if samples is not None:
            line["samples"] = samples
            line["samples_per_s"] = round(samples / seconds, 3) if seconds > 0 else None
        line.update(compute_s=round(compute / 1e9, 6), comm_s=round(comm / 1e9, 6), comm_bytes=sent)
        if generation is not None:
            line["generation"] = generation
        line.update(extra)
        os.write(self._fd, (json.dumps(line) + "\n").encode())
        return line

    def close(self) -> None:
        events.detach(self)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # ---- events.Sink -------------------------------------------------------------------------

    def complete(self, name: str, cat: str, start_ns: int, end_ns: int, tid: int, args: dict[str, Any]) -> None:
        with self._lock:
            if cat == events.COMPUTE:
                self._compute_ns += end_ns - start_ns
            elif cat in events.COMMUNICATING:
                self._comm_ns += end_ns - start_ns
                self._comm_bytes += args.get("bytes", 0)

    def instant(self, name: str, cat: str, ts_ns: int, tid: int, args: dict[str, Any]) -> None:
        pass

    def flow(self, begins: bool, flow_id: int, ts_ns: int, tid: int) -> None:
        pass

    def process(self, rank: int | None, clock_offset_ns: int | None) -> None:
        if rank is not None:
            self.rank = rank
