"""shoal.pipeline beside torch.distributed.pipelining: the same program (stages passing two tensors, a
chunked keyword argument, losses, eval, scale_grads both ways) gives the same outputs, losses and
gradients on torch (gloo) and on shoal, for every schedule, one stage per rank and several; and each
schedule's order per rank is torch's, and cannot deadlock.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch import nn

from shoal.pipeline import orders
from tests.ranks import run_ranks

CPU = torch.device("cpu")


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(6, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        return (h * mask if mask is not None else h), self.b(x)


class Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, skip: torch.Tensor, mask: torch.Tensor | None = None):
        return torch.tanh(self.a(h)) + skip, skip  # keyword arguments reach every stage of the rank that passes them


class Tail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 3)

    def forward(self, h: torch.Tensor, skip: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.a(h + skip)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return (torch.randn(12, 6, generator=gen, dtype=torch.float64),
            (torch.rand(12, 8, generator=gen) > 0.2).double(), torch.randint(0, 3, (12,), generator=gen))


def _train(rank: int, world: int, pp: Any, schedule: str, per_rank: int, m: int, scale: bool) -> list[dict]:
    """Two training steps and an eval with `pp` (shoal.pipeline or torch's), as a torch user writes them."""
    num_stages = world * per_rank
    torch.manual_seed(0)
    modules = [Head().double()] + [Middle().double() for _ in range(num_stages - 2)] + [Tail().double()]
    mine = [s for s in range(num_stages) if s % world == rank]
    stages = [pp.PipelineStage(modules[s], s, num_stages, CPU) for s in mine]
    run = getattr(pp, schedule)(stages[0] if per_rank == 1 else stages, m, loss_fn=nn.functional.cross_entropy,
                                scale_grads=scale)
    first, last = 0 in mine, num_stages - 1 in mine
    record = []
    for step in range(3):
        for s in mine:
            modules[s].zero_grad()
        x, mask, y = _batch(step)
        losses: list = []
        args, kwargs = ((x,), {"mask": mask}) if first else ((), {})
        call = run.eval if step == 2 else run.step
        out = call(*args, **kwargs, **({"target": y, "losses": losses} if last else {}))
        grads = {f"{s}.{n}": p.grad.clone() for s in mine for n, p in modules[s].named_parameters()
                 if p.grad is not None}
        record.append({"out": out, "losses": losses, "grads": grads})
    return record


def _both(rank: int, world: int, torch_port: int, cases: list[tuple]) -> tuple[list, list]:
    import torch.distributed as torch_dist
    import torch.distributed.pipelining as torch_pp

    import shoal.pipeline as shoal_pp

    ours = [_train(rank, world, shoal_pp, *case) for case in cases]
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=world)
    try:
        theirs = [_train(rank, world, torch_pp, *case) for case in cases]
    finally:
        torch_dist.destroy_process_group()
    return ours, theirs


def _assert_close(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, f"{where}: {a!r} {b!r}"
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=where)
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} {b!r}"
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_close(x, y, f"{where}[{k}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: {sorted(a)} {sorted(b)}"
        for k in a:
            _assert_close(a[k], b[k], f"{where}[{k}]")
    else:
        assert a == b, f"{where}: {a!r} {b!r}"


CASES = {
    2: [("ScheduleGPipe", 1, 4, True), ("Schedule1F1B", 1, 3, False), ("ScheduleInterleaved1F1B", 2, 4, True),
        ("ScheduleInterleaved1F1B", 3, 2, False), ("ScheduleLoopedBFS", 2, 4, True)],
    3: [("Schedule1F1B", 1, 4, True), ("ScheduleInterleaved1F1B", 2, 6, True)],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_every_schedule_trains_as_torchs_pipelining_does(world: int) -> None:
    from shoal.ports import free_port

    outcomes = run_ranks(_both, world, free_port(), CASES[world], timeout=240)
    for rank, (ours, theirs) in outcomes.items():
        for case, mine, torchs in zip(CASES[world], ours, theirs, strict=True):
            _assert_close(mine, torchs, f"rank {rank}, {case}")
    last_rank = (world * CASES[world][0][1] - 1) % world
    assert outcomes[last_rank][0][0][0]["out"].shape == (12, 3)  # the last stage's merged output is there


def _one_rank_many_stages(rank: int, world: int) -> tuple[list, torch.Tensor]:
    """All four stages on one rank: every hand-over is local, none goes through the network."""
    import shoal.pipeline as shoal_pp

    record = _train(rank, world, shoal_pp, "ScheduleLoopedBFS", 4, 4, True)
    torch.manual_seed(0)
    model = [Head().double(), Middle().double(), Middle().double(), Tail().double()]
    x, mask, y = _batch(0)
    rows = torch.tensor_split(torch.arange(12), 4)
    losses = []
    for r in rows:
        h = model[0](x[r], mask[r])
        for module in model[1:]:
            h = module(*h) if isinstance(h, tuple) else module(h)
        losses.append(nn.functional.cross_entropy(h, y[r]))
    torch.stack(losses).mean().backward()
    return record, torch.cat([p.grad.flatten() for module in model for p in module.parameters()])


def test_stages_that_follow_each_other_on_one_rank_hand_over_directly() -> None:
    record, expected = run_ranks(_one_rank_many_stages, 1, timeout=60)[0]
    grads = record[0]["grads"]
    got = torch.cat([grads[name].flatten() for name in grads])  # stage order, then each module's own order
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert len(record[0]["losses"]) == 4


# ---- orders ----------------------------------------------------------------------------------------


def _torch_order(name: str, ranks: int, per_rank: int, m: int, rank: int) -> list[orders.Action]:
    """torch's own order for a rank, from its schedule classes' order builders."""
    from torch.distributed.pipelining import schedules

    state = types.SimpleNamespace(n_local_stages=per_rank, pp_group_size=ranks, _n_microbatches=m,
                                  _stages=[None] * per_rank, _num_stages=ranks * per_rank)
    state.number_of_rounds = max(1, m // ranks)
    state.microbatches_per_round = m // state.number_of_rounds
    cls = getattr(schedules, name)
    actions = (cls._get_pipeline_order(state)[rank] if name == "ScheduleGPipe"
               else cls._calculate_single_rank_operations(state, rank))
    return [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in actions
            if a is not None and a.computation_type.value in ("F", "B")]


def _shoal_order(name: str, ranks: int, per_rank: int, m: int, rank: int) -> list[orders.Action]:
    if name == "ScheduleGPipe":
        return orders.gpipe(rank, m)
    if name == "Schedule1F1B":
        return orders.one_f_one_b(rank, ranks, m)
    build = orders.interleaved_1f1b if name == "ScheduleInterleaved1F1B" else orders.looped_bfs
    return build(rank, ranks, per_rank, m)


def _deadlocks(per_rank_orders: list[list[orders.Action]], num_stages: int) -> bool:
    """Whether ranks running these orders, sends never blocking, would wait on each other forever."""
    done: set[orders.Action] = set()
    position = [0] * len(per_rank_orders)
    progress = True
    while progress:
        progress = False
        for rank, order in enumerate(per_rank_orders):
            while position[rank] < len(order):
                kind, s, j = order[position[rank]]
                needs = ([("F", s - 1, j)] if kind == "F" and s > 0 else
                         [("F", s, j)] + ([("B", s + 1, j)] if s < num_stages - 1 else []) if kind == "B" else [])
                if not all(need in done for need in needs):
                    break
                done.add(order[position[rank]])
                position[rank] += 1
                progress = True
    return any(position[rank] < len(order) for rank, order in enumerate(per_rank_orders))


GRID = [(name, ranks, per_rank, m) for name, per_ranks in (("ScheduleGPipe", (1,)), ("Schedule1F1B", (1,)),
                                                            ("ScheduleInterleaved1F1B", (2, 3)),
                                                            ("ScheduleLoopedBFS", (1, 2, 3)))
        for ranks in (1, 2, 3, 4) for per_rank in per_ranks for m in (1, 2, 3, 4, 6, 8, 12)
        if name != "ScheduleInterleaved1F1B" or m % max(1, m // ranks) == 0]


@pytest.mark.parametrize(("name", "ranks", "per_rank", "m"), GRID)
def test_orders_are_torchs_and_never_deadlock(name: str, ranks: int, per_rank: int, m: int) -> None:
    ours = [_shoal_order(name, ranks, per_rank, m, rank) for rank in range(ranks)]
    if name != "Schedule1F1B":  # torch's 1F1B runs its order in code; its order table for display has slips
        assert ours == [_torch_order(name, ranks, per_rank, m, rank) for rank in range(ranks)]
    num_stages = ranks * per_rank
    every = {(kind, s, j) for kind in "FB" for s in range(num_stages) for j in range(m)}
    assert sorted(a for order in ours for a in order) == sorted(every)  # each action once, on its stage's rank
    assert all(s % ranks == rank for rank, order in enumerate(ours) for _, s, _ in order)
    assert not _deadlocks(ours, num_stages)


def test_the_deadlock_check_can_fail() -> None:
    # Stage 1 waits for micro-batch 1 before micro-batch 0's gradient goes back, while stage 0 waits for that
    # gradient before sending micro-batch 1.
    assert _deadlocks([[("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)],
                       [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)]], 2)


def test_interleaved_1f1b_refuses_micro_batches_its_rounds_do_not_divide() -> None:
    with pytest.raises(ValueError, match="n_microbatches=5 must be a multiple of the number of rounds 2"):
        orders.interleaved_1f1b(0, 2, 2, 5)
