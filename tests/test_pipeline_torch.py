"""shoal.pipeline beside torch.distributed.pipelining: the same program (stages passing two tensors, a
chunked keyword argument, losses, eval, scale_grads both ways) gives the same outputs, losses and
gradients on torch (gloo) and on shoal, for every schedule: one stage per rank, several looped, two in a
V, backwards whole or split in halves; each schedule's order per rank is torch's, and cannot deadlock; and
torch's own pipelining trains on backend "shoal" as it does on gloo.
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
    mine = _stages_of(schedule, rank, world, per_rank)
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
        call = run.eval if step == 2 and schedule not in V_SHAPED else run.step  # torch's eval fails on a V
        out = call(*args, **kwargs, **({"target": y, "losses": losses} if last else {}))
        grads = {f"{s}.{n}": p.grad.clone() for s in mine for n, p in modules[s].named_parameters()
                 if p.grad is not None}
        record.append({"out": out, "losses": losses, "grads": grads})
    return record


def _both(rank: int, world: int, torch_port: int, cases: list[tuple]) -> tuple[list, list]:
    import shoal.pipeline as shoal_pp

    ours = [_train(rank, world, shoal_pp, *case) for case in cases]
    return ours, _torchs_on(rank, world, "gloo", torch_port, cases)


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


def _stages_of(schedule: str, rank: int, ranks: int, per_rank: int) -> list[int]:
    if schedule in V_SHAPED:
        return [rank, 2 * ranks - 1 - rank]
    return [s for s in range(ranks * per_rank) if s % ranks == rank]


V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
CASES = {
    2: [("ScheduleGPipe", 1, 4, True), ("Schedule1F1B", 1, 3, False), ("ScheduleInterleaved1F1B", 2, 4, True),
        ("ScheduleInterleaved1F1B", 3, 2, False), ("ScheduleLoopedBFS", 2, 4, True),
        ("ScheduleInterleavedZeroBubble", 2, 4, True), ("ScheduleZBVZeroBubble", 2, 3, True),
        ("ScheduleDualPipeV", 2, 6, False)],
    3: [("Schedule1F1B", 1, 4, True), ("ScheduleInterleaved1F1B", 2, 6, True),
        ("ScheduleInterleavedZeroBubble", 2, 3, True), ("ScheduleZBVZeroBubble", 2, 6, True)],
    4: [("Schedule1F1B", 1, 6, True), ("ScheduleInterleavedZeroBubble", 2, 4, True)],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_every_schedule_trains_as_torchs_pipelining_does(world: int) -> None:
    from shoal.ports import free_port

    outcomes = run_ranks(_both, world, free_port(), CASES[world], timeout=240)
    for rank, (ours, theirs) in outcomes.items():
        for case, mine, torchs in zip(CASES[world], ours, theirs, strict=True):
            _assert_close(mine, torchs, f"rank {rank}, {case}")
    last_rank = world - 1 if CASES[world][0][1] == 1 else 0
    assert outcomes[last_rank][0][0][0]["out"].shape == (12, 3)  # the last stage's merged output is there


def _torchs_on(rank: int, world: int, backend: str, port: int, cases: list[tuple]) -> list:
    import torch.distributed as torch_dist
    import torch.distributed.pipelining as torch_pp

    import shoal  # noqa: F401 - registers backend "shoal"

    torch_dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        return [_train(rank, world, torch_pp, *case) for case in cases]
    finally:
        torch_dist.destroy_process_group()


def _torchs_on_both(rank: int, world: int, ports: tuple[int, int], cases: list[tuple]) -> tuple[list, list]:
    return (_torchs_on(rank, world, "shoal", ports[0], cases), _torchs_on(rank, world, "gloo", ports[1], cases))


def test_torchs_own_pipelining_trains_on_backend_shoal_as_on_gloo() -> None:
    """Every schedule's sends and receives (batch_isend_irecv of several at once in the V-shaped ones)
    through shoal's torch backend give gloo's outputs, losses and gradients."""
    from shoal.ports import free_port

    outcomes = run_ranks(_torchs_on_both, 2, (free_port(), free_port()), CASES[2], timeout=240)
    for rank, (on_shoal, on_gloo) in outcomes.items():
        for case, ours, theirs in zip(CASES[2], on_shoal, on_gloo, strict=True):
            _assert_close(ours, theirs, f"rank {rank}, {case}")


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


def _zero_bubble_alone(rank: int, world: int) -> dict:
    """ZB-V on one rank (its two stages hand over locally): the split backward gives the full backward's
    gradients, and a stage with a dw_builder has its runner built at each input half and run at its
    weight half, as torch's contract says."""
    import shoal.pipeline as shoal_pp

    torch.manual_seed(0)
    head, tail = Head().double(), Tail().double()
    calls: list[str] = []

    def dw_builder():
        calls.append("built")
        return lambda: calls.append("ran")

    stages = [shoal_pp.PipelineStage(head, 0, 2, CPU), shoal_pp.PipelineStage(tail, 1, 2, CPU, dw_builder=dw_builder)]
    schedule = shoal_pp.ScheduleZBVZeroBubble(stages, 3, loss_fn=nn.functional.cross_entropy)
    x, mask, y = _batch(0)
    schedule.step(x, mask=mask, target=y)
    got = [p.grad.clone() for p in head.parameters()]
    head.zero_grad()
    rows = torch.tensor_split(torch.arange(12), 3)
    torch.stack([nn.functional.cross_entropy(tail(*head(x[r], mask[r])), y[r]) for r in rows]).mean().backward()
    evaluated = schedule.eval(x, mask=mask)
    return {"got": got, "want": [p.grad for p in head.parameters()], "calls": calls, "eval": evaluated,
            "unsplit": tail(*head(x, mask)).detach(), "order": schedule._order()}


def test_zero_bubble_halves_add_up_and_a_dw_builder_runs_at_the_weight_half() -> None:
    out = run_ranks(_zero_bubble_alone, 1, timeout=60)[0]
    for got, want in zip(out["got"], out["want"], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert [kind for kind, s, _ in out["order"] if s == 1 and kind in "IW"] == ["I", "W"] * 3
    assert out["calls"] == ["built", "ran"] * 3
    torch.testing.assert_close(out["eval"], out["unsplit"], rtol=0, atol=1e-12)


# ---- micro-batches -------------------------------------------------------------------------------


def test_arguments_are_cut_and_outputs_merged_as_torch_does() -> None:
    from torch.distributed.pipelining import microbatch as torch_mb

    from shoal.pipeline import microbatch as shoal_mb

    gen = torch.Generator().manual_seed(0)
    x, mask = torch.randn(7, 4, generator=gen), torch.randn(3, 7, generator=gen)
    args, kwargs = (x, {"mask": mask, "scale": 2.0}), {"table": torch.randn(5, 2, generator=gen), "flag": True}

    def specs(mb):
        return ((mb.TensorChunkSpec(0), {"mask": mb.TensorChunkSpec(1), "scale": torch_mb._Replicate()}),
                {"table": torch_mb._Replicate, "flag": torch_mb._Replicate()})

    theirs = torch_mb.split_args_kwargs_into_chunks(args, kwargs, 3, *specs(torch_mb))
    for mb in (shoal_mb, torch_mb):  # shoal's functions take either module's specs
        _assert_close(shoal_mb.split_args_kwargs_into_chunks(args, kwargs, 3, *specs(mb)), theirs, mb.__name__)
    _assert_close(shoal_mb.split_args_kwargs_into_chunks(args, None, 3), torch_mb.split_args_kwargs_into_chunks(
        args, None, 3), "split with default specs")
    outputs = [{"y": torch.full((2, 3), float(j))} for j in range(3)]
    _assert_close(shoal_mb.merge_chunks(outputs, None), torch_mb.merge_chunks(outputs, None), "merge by default")
    outputs = [(torch.full((2, 3), float(j)), torch.tensor(float(j))) for j in range(3)]
    spec = (torch_mb.TensorChunkSpec(1), torch_mb.sum_reducer)
    _assert_close(shoal_mb.merge_chunks(outputs, spec), torch_mb.merge_chunks(outputs, spec), "merge by spec")
    with pytest.raises(ValueError, match=r"cannot cut a tensor of shape \(7, 4\) along dim 0 into 8 micro-batches"):
        shoal_mb.split_args_kwargs_into_chunks(args, kwargs, 8)


# ---- orders ----------------------------------------------------------------------------------------


def _torch_order(name: str, ranks: int, per_rank: int, m: int, rank: int) -> list[orders.Action]:
    """torch's own order for a rank, from its schedule classes' order builders."""
    from torch.distributed.pipelining import schedules

    state = types.SimpleNamespace(n_local_stages=per_rank, pp_group_size=ranks, _n_microbatches=m,
                                  _stages=[None] * per_rank, _num_stages=ranks * per_rank, num_stages=ranks * per_rank)
    state.number_of_rounds = max(1, m // ranks)
    state.microbatches_per_round = m // state.number_of_rounds
    cls = getattr(schedules, name)
    actions = (cls._get_pipeline_order(state)[rank] if name == "ScheduleGPipe"
               else cls._calculate_single_rank_operations(state, rank))
    flat = [sub for a in actions if a is not None for sub in (a.sub_actions or (a,))]  # DualPipeV pairs F and B
    return [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in flat
            if a.computation_type.value in ("F", "B", "I", "W")]


def _shoal_order(name: str, ranks: int, per_rank: int, m: int, rank: int) -> list[orders.Action]:
    if name == "ScheduleGPipe":
        return orders.gpipe(rank, m)
    if name == "Schedule1F1B":
        return orders.one_f_one_b(rank, ranks, m)
    if name == "ScheduleZBVZeroBubble":
        return orders.zbv_zero_bubble(rank, ranks, m)
    if name == "ScheduleDualPipeV":
        return orders.dualpipe_v(rank, ranks, m)
    if name == "ScheduleInterleavedZeroBubble":
        return orders.interleaved_1f1b(rank, ranks, per_rank, m, zero_bubble=True)
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
                if kind == "F":
                    ready = s == 0 or ("F", s - 1, j) in done
                elif kind == "W":
                    ready = ("I", s, j) in done
                else:  # a backward, whole or its input half, needs the next stage's
                    ready = ("F", s, j) in done and (s == num_stages - 1 or ("B", s + 1, j) in done)
                if not ready:
                    break
                done.add(("B", s, j) if kind == "I" else (kind, s, j))
                done.add((kind, s, j))
                position[rank] += 1
                progress = True
    return any(position[rank] < len(order) for rank, order in enumerate(per_rank_orders))


STAGES_PER_RANK = {"ScheduleGPipe": (1,), "Schedule1F1B": (1,), "ScheduleInterleaved1F1B": (2, 3),
                   "ScheduleLoopedBFS": (1, 2, 3), "ScheduleInterleavedZeroBubble": (2, 3),
                   "ScheduleZBVZeroBubble": (2,), "ScheduleDualPipeV": (2,)}


def _allowed(name: str, ranks: int, m: int) -> bool:
    """The micro-batch counts a schedule takes: whole rounds for the interleaved ones, m >= stages for DualPipeV."""
    if "Interleaved" in name:
        return m % max(1, m // ranks) == 0
    return name != "ScheduleDualPipeV" or m >= 2 * ranks


GRID = [(name, ranks, per_rank, m) for name, per_ranks in STAGES_PER_RANK.items() for ranks in (1, 2, 3, 4)
        for per_rank in per_ranks for m in (1, 2, 3, 4, 6, 8, 12) if _allowed(name, ranks, m)]


@pytest.mark.parametrize(("name", "ranks", "per_rank", "m"), GRID)
def test_orders_are_torchs_and_never_deadlock(name: str, ranks: int, per_rank: int, m: int) -> None:
    ours = [_shoal_order(name, ranks, per_rank, m, rank) for rank in range(ranks)]
    if name != "Schedule1F1B":  # torch's 1F1B runs its order in code; its order table for display has slips
        assert ours == [_torch_order(name, ranks, per_rank, m, rank) for rank in range(ranks)]
    num_stages = ranks * per_rank
    # Each forward once, and each backward once: whole, or both halves.
    done = [("B", s, j) if kind == "I" else (kind, s, j) for order in ours for kind, s, j in order if kind != "W"]
    assert sorted(done) == sorted((kind, s, j) for kind in "FB" for s in range(num_stages) for j in range(m))
    halves = sorted((s, j) for order in ours for kind, s, j in order if kind == "I")
    assert halves == sorted((s, j) for order in ours for kind, s, j in order if kind == "W")
    assert all(s in _stages_of(name, rank, ranks, per_rank) for rank, order in enumerate(ours) for _, s, _ in order)
    assert not _deadlocks(ours, num_stages)


def test_the_deadlock_check_can_fail() -> None:
    # Stage 1 waits for micro-batch 1 before micro-batch 0's gradient goes back, while stage 0 waits for that
    # gradient before sending micro-batch 1.
    assert _deadlocks([[("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)],
                       [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)]], 2)


def test_interleaved_1f1b_refuses_micro_batches_its_rounds_do_not_divide() -> None:
    with pytest.raises(ValueError, match="n_microbatches=5 must be a multiple of the number of rounds 2"):
        orders.interleaved_1f1b(0, 2, 2, 5)
    with pytest.raises(ValueError, match="n_microbatches=3 must be at least the number of stages 4"):
        orders.dualpipe_v(0, 2, 3)
