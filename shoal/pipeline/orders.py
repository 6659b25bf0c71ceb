"""The order in which each rank runs its stages' forwards and backwards, for every schedule: pure functions
of (ranks, stages per rank, micro-batches, rank), the same orders torch.distributed.pipelining runs.

An action is (kind, stage, micro-batch): "F" a forward, "B" a full backward. Within one stage every
schedule runs the forwards in micro-batch order; LoopedBFS runs the backwards in reverse.
"""

from __future__ import annotations

from collections import Counter

Action = tuple[str, int, int]


def gpipe(stage: int, m: int) -> list[Action]:
    """All forwards, then all backwards: a stage holds all m micro-batches at the peak."""
    return [("F", stage, j) for j in range(m)] + [("B", stage, j) for j in range(m)]


def one_f_one_b(stage: int, num_stages: int, m: int) -> list[Action]:
    """(num_stages - stage - 1) warm-up forwards, then one forward and one backward in turn, then the
    remaining backwards: a stage holds at most num_stages - stage micro-batches at once."""
    warmup = min(num_stages - stage - 1, m)
    steady = [action for k in range(m - warmup) for action in (("F", stage, warmup + k), ("B", stage, k))]
    return [("F", stage, j) for j in range(warmup)] + steady + [("B", stage, j) for j in range(m - warmup, m)]


def looped_bfs(rank: int, ranks: int, local_stages: int, m: int) -> list[Action]:
    """Breadth first: every micro-batch through this rank's first stage, then its next; backwards from
    the last stage, micro-batches in reverse."""
    stages = range(rank, ranks * local_stages, ranks)
    forwards = [("F", s, j) for s in stages for j in range(m)]
    return forwards + [("B", s, j) for s in reversed(stages) for j in reversed(range(m))]


def interleaved_1f1b(rank: int, ranks: int, local_stages: int, m: int) -> list[Action]:
    """Depth first (Narayanan et al. 2021): micro-batches go through this rank's stages in rounds of
    `ranks` (or fewer), warm-up forwards fill the pipeline, then forwards and backwards alternate."""
    rounds = max(1, m // ranks)
    if m % rounds:
        raise ValueError(f"ScheduleInterleaved1F1B: n_microbatches={m} must be a multiple of the number of rounds "
                         f"{rounds} (n_microbatches // pp group size, at least 1)")
    per_round, total, v = m // rounds, m * local_stages, local_stages
    warmup = min((v - 1) * per_round + 2 * (ranks - 1 - rank), total)
    forwards = _numbered("F", [((k // per_round) % v) * ranks + rank for k in range(total)])
    backwards = _numbered("B", [(v - 1 - (k // per_round) % v) * ranks + rank for k in range(total)])
    steady = [action for k in range(total - warmup) for action in (forwards[warmup + k], backwards[k])]
    return forwards[:warmup] + steady + backwards[total - warmup:]


def _numbered(kind: str, stages: list[int]) -> list[Action]:
    """Give each visit of a stage the next micro-batch of that stage."""
    seen: Counter[int] = Counter()
    actions = []
    for s in stages:
        actions.append((kind, s, seen[s]))
        seen[s] += 1
    return actions
