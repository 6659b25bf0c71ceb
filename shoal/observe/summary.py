"""Where each rank's time went, from its timeline: computing, communicating, both at once (the
communication hidden behind compute), or neither (idle: waiting, or work the trace does not show),
and which rank is slowest.

Each share is of the rank's window, from the start of its first compute span to the end of its last
(the training, without the set-up before it); the four add up to it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shoal.observe import events
from shoal.observe.traces import ProcessTrace, load

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Of two sorted, disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _clip(intervals: list[Interval], first: float, last: float) -> list[Interval]:
    return [(max(a, first), min(b, last)) for a, b in intervals if b > first and a < last]


def rank_summary(spans: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds and shares of one rank's window; `hidden` is the share of communication time during
    which the rank also computed."""
    compute = union((e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") == events.COMPUTE)
    window = compute or union((e["ts"], e["ts"] + e["dur"]) for e in spans)
    first, last = (window[0][0], window[-1][1]) if window else (0.0, 0.0)
    comm = _clip(union((e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") in events.COMMUNICATING),
                 first, last)
    both = length(intersection(compute, comm))
    total = last - first
    compute_s, comm_s = length(compute), length(comm)
    busy = compute_s + comm_s - both
    shares = {"compute_only": compute_s - both, "comm_only": comm_s - both, "overlap": both, "idle": total - busy}
    return {"window_s": total / 1e6, "compute_s": compute_s / 1e6, "comm_s": comm_s / 1e6,
            **{name: (value / total if total else 0.0) for name, value in shares.items()},
            "hidden": both / comm_s if comm_s else 0.0}


def summarize(traces: list[ProcessTrace]) -> dict[str, Any]:
    """Per rank (several files of one rank, a restarted worker's, count together); the slowest rank is
    the one that computed longest, the one the others wait for at their collectives."""
    by_rank: dict[Any, list[dict[str, Any]]] = {}
    for trace in traces:
        key = trace.rank if trace.rank is not None else trace.path.name
        by_rank.setdefault(key, []).extend(e for e in trace.events if e.get("ph") == "X")
    ranks = {key: rank_summary(spans) for key, spans in by_rank.items()}
    slowest = max(ranks, key=lambda key: ranks[key]["compute_s"]) if ranks else None
    return {"ranks": ranks, "slowest": slowest}


def render(summary: dict[str, Any]) -> str:
    lines = [f"{'rank':>6} {'window':>9} {'compute':>8} {'comm':>8} {'overlap':>8} {'idle':>8} {'hidden':>7}"]
    for key, s in summary["ranks"].items():
        lines.append(f"{key!s:>6} {s['window_s']:8.3f}s {s['compute_only']:8.1%} {s['comm_only']:8.1%} "
                     f"{s['overlap']:8.1%} {s['idle']:8.1%} {s['hidden']:7.1%}")
    lines.append("compute, comm: time doing only that; overlap: both at once; hidden: the share of "
                 "communication time overlapped by compute")
    if summary["slowest"] is not None:
        s = summary["ranks"][summary["slowest"]]
        lines.append(f"slowest rank: {summary['slowest']} ({s['compute_s']:.3f}s computing; the others wait "
                     f"for it at collectives)")
    return "\n".join(lines)


def summary_of(directory: Path) -> dict[str, Any]:
    return summarize(load(directory))
