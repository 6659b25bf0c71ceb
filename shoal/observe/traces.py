"""Reading a trace directory after a run: each process's timeline file (timeline.py), its rank and
clock offset, and the merge of them all into one file for Perfetto or chrome://tracing, with process
id = rank and every rank's times on rank 0's clock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.observe.timeline import CLOCK_OFFSET, RANK


@dataclass
class ProcessTrace:
    """One process's events, with times already moved onto rank 0's clock."""

    path: Path
    rank: int | None
    events: list[dict[str, Any]] = field(default_factory=list)


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events of one timeline file: one per line, so a file cut short by a crash loses at most its
    last, half-written line."""
    found = []
    for line in path.read_text().splitlines():
        text = line.strip().strip(",")
        if text in ("", "[", "]"):
            continue
        try:
            found.append(json.loads(text))
        except json.JSONDecodeError:
            continue  # the line a killed process was writing
    return found


def load(directory: Path) -> list[ProcessTrace]:
    """Every timeline file in `directory`, aligned on rank 0's clock, in rank order."""
    files = sorted(directory.glob("rank*.json"))
    if not files:
        raise FileNotFoundError(f"no timeline files (rank*.json) in {directory}; write them with "
                                f"`shoal run --trace {directory} ...` or SHOAL_TRACE={directory}")
    traces = []
    for path in files:
        found = read_events(path)
        rank, offset_us = None, 0.0
        for event in found:
            if event.get("ph") == "M" and event.get("name") == RANK:
                rank = event["args"]["rank"]
            elif event.get("ph") == "M" and event.get("name") == CLOCK_OFFSET:
                offset_us = event["args"]["us"]
        for event in found:
            if "ts" in event:
                event["ts"] += offset_us
            if rank is not None:
                event["pid"] = rank
        traces.append(ProcessTrace(path, rank, found))
    return sorted(traces, key=lambda t: (t.rank is None, t.rank if t.rank is not None else 0, t.path.name))


def merge(directory: Path, out: Path) -> int:
    """Write one trace of every rank to `out`, times counted from the first event; returns the event count."""
    traces = load(directory)
    merged = [event for trace in traces for event in trace.events]
    start = min((e["ts"] for e in merged if "ts" in e), default=0.0)
    for event in merged:
        if "ts" in event:
            event["ts"] = round(event["ts"] - start, 3)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"traceEvents": merged, "displayTimeUnit": "ms",
                               "otherData": {"start_wall_us": start, "files": [t.path.name for t in traces]}}))
    return len(merged)
