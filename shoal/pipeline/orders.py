"""The order in which each rank runs its stages' forwards and backwards, for every schedule: pure functions
of (ranks, stages per rank, micro-batches, rank), the same orders torch.distributed.pipelining runs.

An action is (kind, stage, micro-batch): "F" a forward, "B" a full backward, or its two halves for the
zero-bubble schedules, "I" the gradients of the stage's inputs and "W" later those of its weights.
Within one stage every schedule runs the forwards in micro-batch order; LoopedBFS runs the backwards in
reverse.
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


def interleaved_1f1b(rank: int, ranks: int, local_stages: int, m: int, *, zero_bubble: bool = False) -> list[Action]:
    """Depth first (Narayanan et al. 2021): micro-batches go through this rank's stages in rounds of
    `ranks` (or fewer), warm-up forwards fill the pipeline, then forwards and backwards alternate.

    With `zero_bubble` (ZB1P, Qi et al. 2024): one warm-up forward fewer per later rank, backwards split
    in two, and each rank r defers the weight halves of its first r backwards to the end."""
    rounds = max(1, m // ranks)
    if m % rounds:
        raise ValueError(f"n_microbatches={m} must be a multiple of the number of rounds {rounds} "
                         f"(n_microbatches // pp group size, at least 1)")
    per_round, total, v = m // rounds, m * local_stages, local_stages
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (ranks - 1 - rank), total)
    forwards = _numbered("F", [((k // per_round) % v) * ranks + rank for k in range(total)])
    backward_stages = [(v - 1 - (k // per_round) % v) * ranks + rank for k in range(total)]
    backwards = _numbered("I" if zero_bubble else "B", backward_stages)
    weights = _numbered("W", backward_stages) if zero_bubble else []
    order = forwards[:warmup]
    for k in range(total):
        if k < total - warmup:
            order.append(forwards[warmup + k])
        order.append(backwards[k])
        if zero_bubble and k >= rank:
            order.append(weights[k - rank])
    return order + weights[max(0, total - rank):]


def zbv_zero_bubble(rank: int, ranks: int, m: int) -> list[Action]:
    """ZB-V (Qi et al. 2024, section 6): two stages per rank in a V, stage `rank` on the way down and
    stage 2*ranks-1-rank on the way back, backwards split in two. Built as if there were at least
    2*ranks-1 micro-batches, then the actions of micro-batches that do not exist are dropped."""
    n = max(2 * ranks - 1, m)
    down, up = rank, 2 * ranks - 1 - rank
    build = _Builder()
    build.repeat(2 * (ranks - rank) - 1, ("F", down))
    build.repeat(rank, ("F", up), ("F", down))
    build.repeat(ranks - rank, ("F", up), ("I", up), ("W", up))
    while build.count("F", up) < build.count("F", down) or build.count("F", down) < n:
        if build.count("F", down) < n:
            build.add("F", down)
        build.repeat(1, ("I", down), ("W", down), ("F", up), ("I", up), ("W", up))
    build.repeat(rank, ("I", down), ("I", up))
    build.repeat(ranks - rank, ("I", down), ("W", down))
    build.repeat(build.count("I", up) - build.count("W", up), ("W", up))
    build.repeat(build.count("I", down) - build.count("W", down), ("W", down))
    return [action for action in build.actions if action[2] < m]


def dualpipe_v(rank: int, ranks: int, m: int) -> list[Action]:
    """DualPipeV (DeepSeek-AI 2024, its V-shaped variant): the same V of stages; in the steady state a
    forward on one leg goes with a full backward on the other (run one after the other here), and
    the last backwards split, their weight halves filling the drain."""
    if m < 2 * ranks:
        raise ValueError(f"n_microbatches={m} must be at least the number of stages {2 * ranks}")
    down, up = rank, 2 * ranks - 1 - rank
    build = _Builder(weights_queued=True)
    build.repeat(2 * (ranks - rank - 1), ("F", down))
    build.repeat(rank + 1, ("F", down), ("F", up))
    build.repeat(ranks - rank - 1, ("I", up), _QUEUED, ("F", up))
    build.repeat(m - 2 * ranks + rank + 1, ("F", down), ("B", up), ("F", up), ("B", down))
    build.repeat(ranks - rank - 1, ("B", up), ("F", up), ("B", down))
    split = False
    for k in range(rank + 1):
        split = split or (k == (rank + 1) // 2 and rank % 2 == 1)
        build.add("I" if split else "B", up)
        split = split or (k == (rank + 1) // 2 and rank % 2 == 0)
        build.add("I" if split else "B", down)
    build.repeat(ranks - rank - 1, _QUEUED, ("I" if split else "B", down))
    build.repeat(rank + 1, _QUEUED)
    return build.actions


_QUEUED = ("W", None)
"""In `_Builder.repeat`: the weight half of the earliest input half whose weight half has not run."""


class _Builder:
    """Appends actions, each stage's micro-batches counted per kind (a full backward and an input half
    share a count). With `weights_queued`, weight halves are not added by kind but taken in the order
    their input halves ran (`_QUEUED`)."""

    def __init__(self, *, weights_queued: bool = False) -> None:
        self.actions: list[Action] = []
        self.counts: Counter[tuple[str, int]] = Counter()
        self.queue: list[tuple[int, int]] | None = [] if weights_queued else None

    def count(self, kind: str, stage: int) -> int:
        return self.counts[kind, stage]

    def add(self, kind: str, stage: int) -> None:
        key = ("I" if kind == "B" else kind, stage)
        j = self.counts[key]
        self.actions.append((kind, stage, j))
        self.counts[key] += 1
        if kind == "I" and self.queue is not None:
            self.queue.append((stage, j))

    def repeat(self, times: int, *actions: tuple[str, int | None]) -> None:
        for _ in range(times):
            for kind, stage in actions:
                if stage is not None:
                    self.add(kind, stage)
                elif self.queue:
                    queued_stage, j = self.queue.pop(0)
                    self.actions.append(("W", queued_stage, j))


def _numbered(kind: str, stages: list[int]) -> list[Action]:
    """Give each visit of a stage the next micro-batch of that stage."""
    seen: Counter[int] = Counter()
    actions = []
    for s in stages:
        actions.append((kind, s, seen[s]))
        seen[s] += 1
    return actions
