"""Pipeline parallelism: GPipe and 1F1B give the unsplit model's losses, outputs and gradients (float64,
batches that micro-batches do not divide, a batch size that changes), 1F1B bounds live activations,
splitting, and errors that name the stages, on "shoal" and "gloo". (Beside torch's own pipelining, and
with several stages per rank: test_pipeline_torch.py.)

Each multi-process run covers many configurations inside its workers: starting ranks costs seconds.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torch import nn

import shoal
import shoal.distributed as dist
from shoal.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, split_sequential
from tests.ranks import run_ranks

BATCHES = (13, 13, 10)  # divisible by neither 3 nor 8; the smaller last batch makes stages re-describe activations
MICROBATCHES = (1, 3, 8)
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
LR = 0.1
CPU = torch.device("cpu")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (size,), generator=gen)


def _step(schedule, stage: PipelineStage, x: torch.Tensor, y: torch.Tensor, losses: list | None):
    if stage.is_last:
        return schedule.step(*((x,) if stage.is_first else ()), target=y, losses=losses)
    return schedule.step(x) if stage.is_first else schedule.step()


def _sgd(module: nn.Module) -> None:
    """Plain SGD by hand: torch.optim's first use imports torch._dynamo, seconds per process on this box."""
    with torch.no_grad():
        for p in module.parameters():
            p -= LR * p.grad


def _train(rank: int, world: int) -> dict:
    """Every schedule and micro-batch count, three SGD steps each; what each stage saw, for the test to compare."""
    results: dict = {}
    stage = PipelineStage(split_sequential(_model(), world)[rank], rank, world, CPU)
    x, _ = _batch(0, BATCHES[0])
    results["inference"] = ScheduleGPipe(stage, 3).step(*((x,) if stage.is_first else ()))  # no loss_fn
    for name, schedule_cls in SCHEDULES.items():
        for m in MICROBATCHES:
            part = split_sequential(_model(), world)[rank]
            stage = PipelineStage(part, rank, world, CPU)
            schedule = schedule_cls(stage, m, loss_fn=nn.functional.cross_entropy)
            record: dict = {"grads": [], "losses": [], "outputs": [], "peaks": []}
            for step, size in enumerate(BATCHES):
                part.zero_grad()
                losses: list = []
                out = _step(schedule, stage, *_batch(step, size), losses if stage.is_last else None)
                record["grads"].append({n: p.grad.clone() for n, p in part.named_parameters()})
                record["peaks"].append(schedule.peak_live_microbatches)
                record["losses"].append(losses)
                record["outputs"].append(out)
                _sgd(part)
            record["params"] = {n: p.detach().clone() for n, p in part.named_parameters()}
            results[name, m] = record
    return results


@functools.cache
def _run(world: int, backend: str) -> dict[int, dict]:
    return run_ranks(_train, world, backend=backend, timeout=100)


@functools.cache
def _reference(m: int) -> list[dict]:
    """The unsplit model on the whole batch, one process: per step its gradients, output, and the
    parameters after the step. Its loss is what scale_grads makes a pipeline's gradients the gradient of:
    the mean over the m micro-batches of each one's mean loss (the batch's mean loss when m divides it)."""
    model = _model()
    steps = []
    for step, size in enumerate(BATCHES):
        x, y = _batch(step, size)
        model.zero_grad()
        out = model(x)
        rows = torch.tensor_split(torch.arange(size), m)
        torch.stack([nn.functional.cross_entropy(out[r], y[r]) for r in rows]).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        _sgd(model)
        steps.append({"x": x, "y": y, "output": out.detach(), "grads": grads,
                      "params": {n: p.detach().clone() for n, p in model.named_parameters()}})
    return steps


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize(("world", "backend"), [(2, "shoal"), (3, "shoal"), (4, "shoal"), (2, "gloo"), (3, "gloo")])
def test_losses_outputs_and_gradients_equal_the_unsplit_model(world: int, backend: str) -> None:
    out = _run(world, backend)
    last = out[world - 1]
    assert _close(last["inference"], _model()(_reference(1)[0]["x"]).detach())
    for name in SCHEDULES:
        for m in MICROBATCHES:
            reference = _reference(m)
            for step, ref in enumerate(reference):
                what = f"{name}, {m} micro-batches, step {step}"
                rows = torch.tensor_split(torch.arange(len(ref["y"])), m)
                expected_losses = [nn.functional.cross_entropy(ref["output"][r], ref["y"][r]) for r in rows]
                losses = last[name, m]["losses"][step]
                assert len(losses) == m and all(map(_close, losses, expected_losses)), what
                assert _close(last[name, m]["outputs"][step], ref["output"]), what
                grads = {n: g for rank in range(world) for n, g in out[rank][name, m]["grads"][step].items()}
                assert grads.keys() == ref["grads"].keys(), what
                assert all(_close(grads[n], ref["grads"][n]) for n in grads), what
            params = {n: p for rank in range(world) for n, p in out[rank][name, m]["params"].items()}
            assert all(_close(params[n], reference[-1]["params"][n]) for n in params), f"{name}, {m}: parameters"
    for rank in range(world - 1):
        assert out[rank]["inference"] is None and out[rank]["gpipe", 3]["outputs"] == [None] * len(BATCHES)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_1f1b_holds_at_most_num_stages_microbatches_gpipe_holds_all(world: int) -> None:
    out = _run(world, "shoal")
    for rank in range(world):
        for m in MICROBATCHES:
            # 1F1B: the warm-up forwards plus the one in flight; GPipe: every micro-batch before the first backward.
            assert out[rank]["1f1b", m]["peaks"] == [min(world - rank, m)] * len(BATCHES)
            assert out[rank]["gpipe", m]["peaks"] == [m] * len(BATCHES)
    assert max(out[0]["1f1b", 8]["peaks"]) == world < 8


def test_a_batch_size_change_between_steps_is_described_anew() -> None:
    out, reference = _run(3, "shoal"), _reference(8)
    assert BATCHES[1] != BATCHES[2]
    last = out[2]["1f1b", 8]
    assert last["outputs"][2].shape == (BATCHES[2], 3) and _close(last["outputs"][2], reference[2]["output"])
    grads = {n: g for rank in range(3) for n, g in out[rank]["1f1b", 8]["grads"][2].items()}
    assert all(_close(grads[n], reference[2]["grads"][n]) for n in grads)


# ---- a one-stage pipeline, mistakes, and errors that name the stages ----------------------------


def _one_stage(rank: int) -> None:
    alone = dist.new_group([0])  # every rank calls new_group; rank 1 gets GroupMember.NON_GROUP_MEMBER
    if rank != 0:
        return
    model = _model()
    x, y = _batch(0, 13)
    schedule = Schedule1F1B(PipelineStage(model, 0, 1, CPU, group=alone), 4, loss_fn=nn.functional.cross_entropy,
                            scale_grads=False)
    out = schedule.step(x, target=y)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    rows = torch.tensor_split(torch.arange(13), 4)
    sum(nn.functional.cross_entropy(model(x[r]), y[r]) for r in rows).backward()  # scale_grads=False: the sum
    assert _close(out, model(x).detach()) and all(map(_close, grads, [p.grad for p in model.parameters()]))


def _argument_mistakes(rank: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Caught before anything is sent: the same schedule then runs a good step."""
    with pytest.raises(ValueError, match="num_stages=3 but the group has 2 ranks"):
        ScheduleGPipe(PipelineStage(nn.Linear(2, 2), rank, 3, CPU), 2)
    with pytest.raises(ValueError, match=rf"group rank {rank} of 2 runs stages \[{rank}\] of 2, but was given "
                                         rf"stages \[{1 - rank}\]"):
        ScheduleGPipe(PipelineStage(nn.Linear(2, 2), 1 - rank, 2, CPU), 2)
    with pytest.raises(ValueError, match="stage_index=2 with num_stages=2"):
        PipelineStage(nn.Linear(2, 2), 2, 2, CPU)
    stage = PipelineStage(nn.Linear(8, 8).double(), rank, 2, CPU, group=dist.new_group([0, 1]))
    with pytest.raises(ValueError, match="n_microbatches must be an int from 1 to 4096, got 0"):
        ScheduleGPipe(stage, 0)
    with pytest.raises(ValueError, match="ScheduleInterleaved1F1B: num_stages=3 must be a multiple of the group's 2"):
        ScheduleInterleaved1F1B([PipelineStage(nn.Linear(2, 2), rank, 3, CPU)], 4)
    schedule = ScheduleGPipe(stage, 3, loss_fn=nn.functional.mse_loss)
    if rank == 0:
        with pytest.raises(ValueError, match=r"cannot cut a tensor of shape \(2, 8\) along dim 0 into 3"):
            schedule.step(x[:2])
        with pytest.raises(ValueError, match="the rank with the first stage must pass the batch"):
            schedule.step()
        schedule.step(x, target=y)  # torch's rule: a target on a rank without the last stage is not used
    else:
        with pytest.raises(ValueError, match="needs target="):
            schedule.step()
        assert schedule.step(x, target=y).shape == (6, 8)  # and so is a batch on a rank without the first


def _corrupt_gradient(rank: int, x: torch.Tensor, y: torch.Tensor) -> str | None:
    """Stage 1 sends back float32 gradients for float64 activations; stage 0 names both stages."""
    stage = PipelineStage(nn.Linear(8, 8).double(), rank, 2, CPU, group=dist.new_group([0, 1]))
    schedule = ScheduleGPipe(stage, 2, loss_fn=nn.functional.mse_loss)
    if rank == 1:
        stage.send_gradients = lambda j, grads: PipelineStage.send_gradients(stage, j, [g.float() for g in grads])
        schedule.step(target=y)
        return None
    with pytest.raises(shoal.CollectiveMismatchError) as info:
        schedule.step(x)
    return str(info.value)


def _disagreement(rank: int, x: torch.Tensor, y: torch.Tensor, m: int, loss_fn) -> str | None:
    """Stage 1's schedule differs from stage 0's (forward-only, 3 micro-batches, so stage 0 just sends)."""
    stage = PipelineStage(nn.Linear(8, 8).double(), rank, 2, CPU, group=dist.new_group([0, 1]))
    if rank == 0:
        ScheduleGPipe(stage, 3).step(x)
        return None
    with pytest.raises(ValueError) as info:
        ScheduleGPipe(stage, m, loss_fn=loss_fn).step(**({"target": y} if loss_fn else {}))
    return str(info.value)


def _errors(rank: int, world: int) -> dict:
    """Each scenario on a fresh subgroup, so that one which fails leaves no messages behind for the next."""
    x, y = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    _one_stage(rank)
    _argument_mistakes(rank, x, y)
    seen = {"gradient": _corrupt_gradient(rank, x, y),
            "n_microbatches": _disagreement(rank, x, y, 4, None),
            "training": _disagreement(rank, x, y, 3, nn.functional.mse_loss)}
    # Last: stage 0 outputs 50 features where stage 1 expects 32. Stage 1 names both stages; stage 0, waiting
    # for gradients, learns that stage 1 left (its process destroys the group on the way out).
    module = nn.Linear(8, 50) if rank == 0 else nn.Linear(32, 4)
    schedule = Schedule1F1B(PipelineStage(module.double(), rank, 2, CPU, group=dist.new_group([0, 1])), 3,
                            loss_fn=nn.functional.mse_loss)
    with pytest.raises(shoal.PeerFailure if rank == 0 else ValueError) as info:
        schedule.step(x) if rank == 0 else schedule.step(target=torch.randn(6, 4, dtype=torch.float64))
    seen["consume"] = str(info.value)
    seen["failed rank"] = getattr(info.value, "rank", None)
    return seen


def test_mistakes_and_mismatches_raise_errors_that_name_the_stages() -> None:
    out = run_ranks(_errors, 2, timeout=60, group_timeout=30)
    assert "stage 0 sent stage 1 the activations of micro-batch 0 (of shape (3, 8) dtype float64)" in out[0]["gradient"]
    assert "stage 1 has n_microbatches=4 but stage 0 has n_microbatches=3" in out[1]["n_microbatches"]
    assert "stage 1 has training=True but stage 0 has training=False" in out[1]["training"]
    assert out[1]["consume"].startswith("stage 1 could not consume the activations from stage 0 (of shape (2, 50) "
                                        "dtype float64): "), out[1]["consume"]
    assert out[0]["failed rank"] == 1 and "left the group" in out[0]["consume"]


def _die_mid_step(rank: int, world: int) -> tuple[str, int | None, str]:
    calls = []

    class DieOnSecondMicrobatch(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            if rank == 1 and len(calls) == 2:
                os._exit(1)  # a crash: no goodbye, the connections just drop
            return x

    stage = PipelineStage(nn.Sequential(nn.Linear(4, 4), DieOnSecondMicrobatch()), rank, world, CPU)
    schedule = Schedule1F1B(stage, 4, loss_fn=nn.functional.mse_loss)
    x = torch.randn(8, 4)
    with pytest.raises(shoal.PeerFailure) as info:
        _step(schedule, stage, x, torch.randn(8, 4), None)
    return type(info.value).__name__, info.value.rank, str(info.value)


@pytest.mark.parametrize("backend", ["shoal", "gloo"])
def test_a_neighbour_that_dies_mid_step_is_named_and_nothing_hangs(backend: str) -> None:
    out = run_ranks(_die_mid_step, 3, backend=backend, expect={1: "dies"}, timeout=60, group_timeout=60)
    for rank in (0, 2):
        name, failed, message = out[rank]
        assert name == "PeerFailure" and failed == 1 and "rank 1" in message, out[rank]


# ---- splitting -----------------------------------------------------------------------------------


def _sizes(stages: list[nn.Sequential]) -> list[int]:
    return [sum(p.numel() for p in stage.parameters()) for stage in stages]


def test_split_sequential_balances_parameter_counts() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 10))
    stages = split_sequential(model, 2)
    # 8,320 + 16,512 + 1,290 parameters: the best cut leaves 17,802 in the larger stage, and the ReLU after
    # the first Linear stays with it.
    assert [list(s._modules) for s in stages] == [["0", "1", "2"], ["3", "4", "5"]]
    assert _sizes(stages) == [8320, 17802]
    assert stages[0][1] is model[1]  # the model's own layers, not copies
    assert _sizes(split_sequential(model, 3)) == [8320, 16512, 1290]
    assert [len(s) for s in split_sequential(model, 6)] == [1] * 6
    even = nn.Sequential(*[nn.Linear(10, 10) for _ in range(8)])
    assert [len(s) for s in split_sequential(even, 4)] == [2, 2, 2, 2]
    skewed = nn.Sequential(nn.Linear(100, 100), *[nn.Linear(10, 10) for _ in range(6)])
    assert [len(s) for s in split_sequential(skewed, 2)] == [1, 6]


def test_split_sequential_by_layer_counts_and_impossible_splits() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])
    assert [list(s._modules) for s in split_sequential(model, 2, balance=[1, 4])] == [["0"], ["1", "2", "3", "4"]]
    with pytest.raises(ValueError, match="cannot cut 5 layers into 6 non-empty stages"):
        split_sequential(model, 6)
    with pytest.raises(ValueError, match="num_stages must be at least 1, got 0"):
        split_sequential(model, 0)
    with pytest.raises(ValueError, match=r"balance=\[2, 2\] .* the model's 5 layers \(it sums to 4\)"):
        split_sequential(model, 2, balance=[2, 2])
    with pytest.raises(ValueError, match=r"balance=\[5, 0\] must hold 2 positive layer counts"):
        split_sequential(model, 2, balance=[5, 0])
    with pytest.raises(ValueError, match=r"balance=\[6, -1\]"):
        split_sequential(model, 2, balance=[6, -1])
    with pytest.raises(ValueError, match=r"balance=\[5\] must hold 2"):
        split_sequential(model, 2, balance=[5])
