"""`shoal trace hang DIR`: from the flight records of all ranks (flight.py), the operation the job is
stuck on, the ranks waiting in it, and the rank that is behind: one that never issued it, or never
sent what another waits to receive.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.observe.flight import FILE_PREFIX


@dataclass
class Finding:
    """A stuck operation: who waits in it and who is behind (never issued it or its matching send)."""

    op: str
    waiting: list[int]
    behind: list[int]
    detail: str


def load_records(directory: Path) -> dict[int, dict[str, Any]]:
    """The newest flight record of each rank in `directory`."""
    records: dict[int, dict[str, Any]] = {}
    for path in sorted(directory.glob(f"{FILE_PREFIX}*.json")):
        record = json.loads(path.read_text())
        rank = record.get("rank")
        if rank is not None and (rank not in records or record["time"] > records[rank]["time"]):
            records[rank] = record
    if not records:
        raise FileNotFoundError(f"no flight records ({FILE_PREFIX}*.json) in {directory}; they are written on "
                                f"SIGUSR1, and on a timeout or a lost peer where SHOAL_TRACE or SHOAL_FLIGHT_DIR "
                                f"names a directory")
    return records


def _not_got_past(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of one rank's operations in one sequence (a group's collectives, or one peer's sends or receives
    with one tag), those it did not get past: not completed (still waiting when dumped, or given up
    on: a timeout, a lost peer), and nothing after them completed (a mismatch fails an operation, and
    the group goes on)."""
    done = max((e["seq"] for e in entries if e["state"] == "completed"), default=-1)
    return [e for e in entries if e["state"] != "completed" and e["seq"] > done]


def _label(entry: dict[str, Any]) -> str:
    return f"{entry['what']} #{entry['seq']} of group {entry['group']}"


def _collective_findings(records: dict[int, dict[str, Any]]) -> list[Finding]:
    groups: dict[tuple, dict[int, list[dict[str, Any]]]] = {}
    for rank, record in records.items():
        for entry in record["entries"]:
            if entry["peer"] is None:
                groups.setdefault((entry["group"], tuple(entry["ranks"])), {}).setdefault(rank, []).append(entry)
    findings = []
    for (_, members), by_rank in groups.items():
        stuck_by_rank = {rank: _not_got_past(entries) for rank, entries in by_rank.items()}
        pending = [e for entries in stuck_by_rank.values() for e in entries]
        if not pending:
            continue
        stuck_seq = min(e["seq"] for e in pending)
        waiting = sorted(r for r, entries in stuck_by_rank.items() if any(e["seq"] == stuck_seq for e in entries))
        stuck = next(e for e in pending if e["seq"] == stuck_seq)
        behind, notes = [], []
        for member in members:
            entries = by_rank.get(member)
            if member not in records:
                behind.append(member)
                notes.append(f"rank {member} left no flight record")
            elif not entries or max(e["seq"] for e in entries) < stuck_seq:
                behind.append(member)
                last = max(entries, key=lambda e: e["seq"]) if entries else None
                notes.append(f"rank {member} never issued it; its last operation in the group: "
                             + (f"{last['what']} #{last['seq']} ({last['state']})" if last else "none recorded"))
        waited = [records[r]["time"] - (e["started"] or e["issued"]) for r in waiting
                  for e in by_rank[r] if e["seq"] == stuck_seq]
        since = f", for up to {max(waited):.1f}s when they dumped" if waited else ""
        findings.append(Finding(_label(stuck), waiting, behind,
                                f"ranks {waiting} wait in it{since}; " + ("; ".join(notes) or
                                "every member issued it (a failure or a mismatch, see each rank's error)")))
    return findings


def _p2p_findings(records: dict[int, dict[str, Any]]) -> list[Finding]:
    findings = []
    for rank, record in records.items():
        receives: dict[tuple, list[dict[str, Any]]] = {}
        for entry in record["entries"]:
            if entry["name"] == "recv":
                receives.setdefault((entry["group"], entry["peer"], entry["tag"]), []).append(entry)
        for entry in (e for entries in receives.values() for e in _not_got_past(entries)):
            peer = entry["peer"]
            sent = peer in records and any(
                e["name"] == "send" and e["peer"] == rank and e["tag"] == entry["tag"] and e["seq"] == entry["seq"]
                and e["group"] == entry["group"] for e in records[peer]["entries"])
            if not sent:
                why = "left no flight record" if peer not in records else "has not sent it"
                label = f"recv #{entry['seq']} from rank {peer} (tag {entry['tag']}, group {entry['group']})"
                detail = f"rank {rank} waits in it; rank {peer} {why}"
                findings.append(Finding(label, [rank], [peer], detail))
    return findings


def diagnose(records: dict[int, dict[str, Any]]) -> list[Finding]:
    return _collective_findings(records) + _p2p_findings(records)


def report(directory: Path) -> str:
    records = load_records(directory)
    findings = diagnose(records)
    lines = [f"flight records of ranks {sorted(records)}"]
    if not findings:
        lines.append("no rank is waiting in an operation: the job is not stuck in communication")
    behind = sorted({r for f in findings for r in f.behind})
    if behind:
        lines.append(f"behind: rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))}")
    lines += [f"stuck on {f.op}: {f.detail}" for f in findings]
    return "\n".join(lines)
