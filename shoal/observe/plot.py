"""`shoal trace plot DIR -o timeline.png`: a picture of the timeline, one band per rank, compute and
communication spans in rows of their own so that their overlap shows (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path

from shoal.observe import events
from shoal.observe.traces import load

_ROWS = {events.COMPUTE: (0, "tab:blue", "compute"), events.COMM: (1, "tab:orange", "communication"),
         events.RPC: (1, "tab:orange", "communication")}


def plot(directory: Path, out: Path, *, last_s: float | None = None) -> None:
    """Draw every rank's spans from its first compute span on, as the summary counts them (the last
    `last_s` seconds only, if given)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("shoal trace plot needs matplotlib: pip install matplotlib") from None
    traces = load(directory)
    spans = [(t.rank, e) for t in traces for e in t.events if e.get("ph") == "X" and e.get("cat") in _ROWS]
    if not spans:
        raise SystemExit(f"no compute or communication spans in the timelines in {directory}")
    computing = [e for _, e in spans if e["cat"] == events.COMPUTE] or [e for _, e in spans]
    start = min(e["ts"] for e in computing)
    end = max(e["ts"] + e["dur"] for e in computing)
    if last_s is not None:
        start = max(start, end - last_s * 1e6)
    ranks = sorted({rank for rank, _ in spans}, key=lambda r: (r is None, r or 0))
    figure, axes = plt.subplots(figsize=(12, 1 + 1.1 * len(ranks)))
    for band, rank in enumerate(ranks):
        for row, color, _ in set(_ROWS.values()):
            bars = [((e["ts"] - start) / 1e3, e["dur"] / 1e3) for r, e in spans
                    if r == rank and _ROWS[e["cat"]][0] == row and e["ts"] + e["dur"] >= start and e["ts"] <= end]
            axes.broken_barh(bars, (band * 3 + row * 1.2, 1), facecolors=color, linewidth=0)
    axes.set_yticks([band * 3 + 1.1 for band in range(len(ranks))], [f"rank {r}" for r in ranks])
    axes.invert_yaxis()
    axes.set_xlim(0, (end - start) / 1e3)
    axes.set_xlabel("milliseconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color) for _, color, _ in sorted(set(_ROWS.values()))]
    axes.legend(handles, [label for *_, label in sorted(set(_ROWS.values()))], loc="upper center",
                bbox_to_anchor=(0.5, -0.25 - 0.1 / len(ranks)), ncol=2, frameon=False)
    axes.set_title(f"timeline of {directory.name}: compute (upper row) and communication (lower) per rank")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
