"""Reading what tests/scripts/live_train.py prints: each generation's reports and each rank's final line."""

from __future__ import annotations


def states(stdout: str) -> tuple[dict[str, list[tuple[str, str]]], dict[str, str]]:
    """From live_train.py's output: per generation, (rank, "size step digest") as each member reported
    it on entering; and per rank, its final line."""
    lines = [line.split(": ", 1) for line in stdout.splitlines() if ": " in line]
    reports: dict[str, list[tuple[str, str]]] = {}
    for who, text in lines:
        if text.startswith("generation "):
            generation, size, step, state = text.split()[1::2]
            reports.setdefault(generation, []).append((who, f"{size} {step} {state}"))
    return reports, {who: text for who, text in lines if text.startswith("samples ")}


def assert_alike(reports: dict[str, list[tuple[str, str]]], finals: dict[str, str]) -> None:
    """After each change of membership, every member holds the same parameters, optimizer state and
    schedule at the same step, and all finish with the same."""
    for entries in reports.values():
        assert len(entries) == int(entries[0][1].split()[0]), entries  # every member reported
        assert len({state for _, state in entries}) == 1, entries
    assert len({text.split(" generation ")[1] for text in finals.values()}) == 1, finals
