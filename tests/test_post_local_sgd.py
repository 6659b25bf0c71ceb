"""Post-local SGD and functional optimizers against torch's: shoal's PostLocalSGDOptimizer and
PeriodicModelAverager (on a "shoal" group) and torch's (on a gloo group) train the same replicas on the same
real ranks to the same parameters, step by step; the DDP hook likewise; as_functional_optim steps as
torch.optim does, reading switches set after construction as torch's functional optimizers do. Bad arguments
raise the error types torch's raise; the messages are not all torch's (the averagers' are shoal's own, with
the values), so the tests match them only on shoal's side."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shoal.comm.api import GroupMember
from shoal.optim import PostLocalSGDOptimizer, as_functional_optim
from shoal.parallel import PeriodicModelAverager
from shoal.parallel.model_averaging import average_parameters, get_params_to_average
from tests.ranks import run_ranks

STEPS, PERIOD, WARMUP = 10, 3, 2
AVERAGED = [s for s in range(STEPS) if s >= WARMUP and (s - WARMUP) % PERIOD == 0]  # 2, 5, 8


class _Net(nn.Module):
    """Two layers in two param groups, and a parameter of its own per rank that no loss reaches: it has no
    gradient, so an averager must leave it alone."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
        self.unused = nn.Parameter(torch.full((3,), float(rank), dtype=torch.float64))

    def snapshot(self) -> list[torch.Tensor]:
        """The parameters, the one no loss reaches last."""
        return [p.detach().clone() for p in [*self.body.parameters(), self.unused]]

    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([{"params": self.body[0].parameters()},
                                {"params": [*self.body[2].parameters(), self.unused], "lr": 0.05}],
                               lr=0.1, momentum=0.9)


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank its own data, so that the replicas drift apart between averagings."""
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(5, 4, generator=gen, dtype=torch.float64),
             torch.randn(5, 2, generator=gen, dtype=torch.float64)) for _ in range(STEPS)]


def _train(net: _Net, opt: torch.optim.Optimizer, batches: list, steps: range) -> list[list[torch.Tensor]]:
    snapshots = []
    for step in steps:
        x, y = batches[step]
        opt.zero_grad()
        nn.functional.mse_loss(net.body(x), y).backward()
        opt.step()
        snapshots.append(net.snapshot())
    return snapshots


def _post_local_sgd(rank: int, world: int, torch_port: int) -> dict[str, Any]:
    """shoal's classes on the "shoal" group run_ranks made, then torch's on a gloo group; and shoal's again,
    stopped after step 4 (mid-period) and resumed from its state dicts in fresh objects."""
    import torch.distributed as torch_dist
    import torch.distributed.algorithms.model_averaging.averagers as torch_averagers
    from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer

    batches, out = _batches(rank), {}
    net = _Net(rank)
    opt = PostLocalSGDOptimizer(net.optimizer(), PeriodicModelAverager(PERIOD, warmup_steps=WARMUP))
    out["shoal"] = _train(net, opt, batches, range(STEPS))
    out["shoal state"] = opt.state_dict()

    net = _Net(rank)
    opt = PostLocalSGDOptimizer(net.optimizer(), PeriodicModelAverager(PERIOD, WARMUP))
    _train(net, opt, batches, range(5))
    saved = {"model": net.state_dict(), "optim": opt.state_dict()}
    net = _Net(rank)
    net.load_state_dict(saved["model"])
    opt = PostLocalSGDOptimizer(net.optimizer(), PeriodicModelAverager(PERIOD, WARMUP))
    opt.load_state_dict(saved["optim"])
    out["resumed from step"] = opt.averager.step
    out["resumed"] = _train(net, opt, batches, range(5, STEPS))

    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=world)
    try:
        net = _Net(rank)
        opt = TorchPostLocalSGDOptimizer(net.optimizer(), torch_averagers.PeriodicModelAverager(PERIOD, WARMUP))
        out["torch"] = _train(net, opt, batches, range(STEPS))
        out["torch state"] = opt.state_dict()
    finally:
        torch_dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_post_local_sgd_optimizer_trains_the_replicas_as_torch_s_does(world: int) -> None:
    from shoal.ports import free_port

    out = run_ranks(_post_local_sgd, world, free_port(), timeout=120)
    for rank in range(world):
        ours, theirs = out[rank]["shoal"], out[rank]["torch"]
        for step in range(STEPS):
            for i, (a, b) in enumerate(zip(ours[step], theirs[step], strict=True)):
                torch.testing.assert_close(a, b, msg=lambda m, r=rank, s=step, i=i: f"rank {r} step {s} param {i}: {m}")
        # The state dicts are torch's, the averager's step under "step" included.
        assert out[rank]["shoal state"]["step"] == out[rank]["torch state"]["step"] == STEPS
        torch.testing.assert_close(out[rank]["shoal state"], out[rank]["torch state"])
        # Resumed from its state dicts, the run goes on as the one never stopped.
        assert out[rank]["resumed from step"] == 5
        for step, snapshot in zip(range(5, STEPS), out[rank]["resumed"], strict=True):
            for a, b in zip(snapshot, ours[step], strict=True):
                torch.testing.assert_close(a, b, msg=lambda m, r=rank, s=step: f"rank {r} resumed, step {s}: {m}")
    # What makes the comparison telling: the trained replicas are equal after the averaging steps only, and
    # the parameter without a gradient is never averaged.
    for step in range(STEPS):
        trained_equal = all(torch.equal(a, b) for r in range(1, world)
                            for a, b in zip(out[0]["shoal"][step][:-1], out[r]["shoal"][step][:-1], strict=True))
        assert trained_equal == (step in AVERAGED), f"step {step}: replicas equal {trained_equal}"
        assert [out[r]["shoal"][step][-1][0].item() for r in range(world)] == [float(r) for r in range(world)]


def _post_local_sgd_hook(rank: int, world: int, torch_port: int) -> dict[str, Any]:
    """The full post-local SGD recipe: DDP with the hook (global averaging of gradients during warm-up, then
    within a subgroup), and the optimizer averaging parameters every PERIOD steps; shoal's then torch's."""
    import torch.distributed as torch_dist
    import torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook as torch_hook
    import torch.distributed.algorithms.model_averaging.averagers as torch_averagers
    from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer

    import shoal.distributed as dist
    from shoal.parallel import DistributedDataParallel, PostLocalSGDState, post_localSGD_hook

    subgroups = [[0], [1]] if world == 2 else [[0, 1], [2]]
    batches, out = _batches(rank), {}

    def run(ddp_cls, state_cls, hook, averager_cls, optim_cls, mine) -> list[list[torch.Tensor]]:
        net = _Net(rank)
        opt = optim_cls(net.optimizer(), averager_cls(PERIOD, WARMUP))
        net.body = ddp_cls(net.body)
        state = state_cls(process_group=None, subgroup=mine, start_localSGD_iter=WARMUP)
        net.body.register_comm_hook(state, hook)
        snapshots = _train(net, opt, batches, range(STEPS))
        out.setdefault("iter", []).append(state.iter)
        return snapshots

    mine, _ = dist.new_subgroups_by_enumeration(subgroups)
    out["shoal"] = run(DistributedDataParallel, PostLocalSGDState, post_localSGD_hook, PeriodicModelAverager,
                       PostLocalSGDOptimizer, mine)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=world)
    try:
        mine, _ = torch_dist.new_subgroups_by_enumeration(subgroups)
        out["torch"] = run(nn.parallel.DistributedDataParallel, torch_hook.PostLocalSGDState,
                           torch_hook.post_localSGD_hook, torch_averagers.PeriodicModelAverager,
                           TorchPostLocalSGDOptimizer, mine)
    finally:
        torch_dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_the_post_local_sgd_hook_with_the_optimizer_trains_as_torch_s(world: int) -> None:
    from shoal.ports import free_port

    out = run_ranks(_post_local_sgd_hook, world, free_port(), timeout=120)
    for rank in range(world):
        assert out[rank]["iter"] == [WARMUP, WARMUP]
        for step in range(STEPS):
            for a, b in zip(out[rank]["shoal"][step], out[rank]["torch"][step], strict=True):
                torch.testing.assert_close(a, b, msg=lambda m, r=rank, s=step: f"rank {r} step {s}: {m}")
    # Between averagings the subgroup keeps its members equal, and the replicas of other subgroups apart.
    last_local = out[0]["shoal"][AVERAGED[-1] - 1]
    apart = world - 1  # rank 1 (world 2) or rank 2 (world 3) trains alone after warm-up
    assert not torch.equal(last_local[0], out[apart]["shoal"][AVERAGED[-1] - 1][0])
    if world == 3:
        assert torch.equal(last_local[0], out[1]["shoal"][AVERAGED[-1] - 1][0])


# ---- in one process: what needs no group ------------------------------------------------------------------

def test_averagers_refuse_what_torch_s_refuse() -> None:
    import torch.distributed.algorithms.model_averaging.averagers as torch_averagers

    outside = GroupMember.NON_GROUP_MEMBER  # a group given, so that no default group is needed
    for kwargs, match in [({"period": 0}, "period must be a positive number of steps, got 0"),
                          ({"period": 2, "warmup_steps": -1}, "warmup_steps must be a non-negative number, got -1")]:
        with pytest.raises(ValueError, match=match):
            PeriodicModelAverager(**kwargs, process_group=outside)
        with pytest.raises(ValueError):
            torch_averagers.PeriodicModelAverager(**kwargs, process_group=outside)
    with pytest.warns(UserWarning, match="period=1"):
        PeriodicModelAverager(1, process_group=outside)
    unbound = PeriodicModelAverager(2)  # no default group to take: LiveTraining gives it each generation's
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="init_process_group"):  # torch's refuses at construction already
        unbound.average_parameters([p])
    with pytest.raises(NotImplementedError, match="got an entry of type str"):  # torch's type
        get_params_to_average(["weight"])
    with pytest.raises(ValueError, match="no parameters to average"):
        average_parameters(iter([]), process_group=object())


def test_a_rank_outside_the_group_keeps_its_parameters_and_counts_its_steps() -> None:
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    averager = PeriodicModelAverager(2, process_group=GroupMember.NON_GROUP_MEMBER)
    for _ in range(3):
        averager.average_parameters([p])
    assert averager.step == 3 and torch.equal(p.detach(), torch.ones(3))


def test_a_state_dict_without_the_averager_s_step_warns_and_restarts_its_count() -> None:
    p = nn.Parameter(torch.ones(2))
    opt = PostLocalSGDOptimizer(torch.optim.SGD([p], lr=0.1),
                                PeriodicModelAverager(2, warmup_steps=1, process_group=GroupMember.NON_GROUP_MEMBER))
    opt.averager.step = 7
    plain = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.3).state_dict()
    with pytest.warns(UserWarning, match="no step count"):
        opt.load_state_dict(plain)
    assert opt.averager.step == 0 and opt.param_groups[0]["lr"] == 0.3
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    assert len(opt.param_groups) == 2 and opt.param_groups is opt.optim.param_groups and opt.state is opt.optim.state


# ---- as_functional_optim ------------------------------------------------------------------------------------

# (class, the functional constructor's keyword arguments, torch.optim's equivalent): defaults differ (the
# functional Adamax's lr is 1e-3, torch.optim's 2e-3), so every case names what it relies on.
_CASES = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99), "amsgrad": True},
     {"lr": 0.01, "betas": (0.8, 0.99), "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 0.01}, {"lr": 0.01, "weight_decay": 1e-2}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.5, "warmup_num_iters": 3.0},
     {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.5}),
    (torch.optim.Adamax, {"lr": 0.002, "weight_decay": 0.1}, {"lr": 0.002, "weight_decay": 0.1}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True},
     {"lr": 0.01, "momentum": 0.5, "centered": True}),
    (torch.optim.Rprop, {"lr": 0.01, "etas": (0.4, 1.3)}, {"lr": 0.01, "etas": (0.4, 1.3)}),
    (torch.optim.Adadelta, {"lr": 0.5, "rho": 0.8, "maximize": True}, {"lr": 0.5, "rho": 0.8, "maximize": True}),
]


def _start() -> tuple[list[torch.Tensor], list[list[torch.Tensor | None]]]:
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(3, 2, generator=gen, dtype=torch.float64), torch.randn(4, generator=gen, dtype=torch.float64)]
    grads: list[list[torch.Tensor | None]] = [[torch.randn(p.shape, generator=gen, dtype=torch.float64)
                                               for p in params] for _ in range(4)]
    grads[1][1] = None  # a step without this parameter's gradient leaves it, and its state, alone
    return params, grads


@pytest.mark.parametrize(("cls", "functional", "optim_kwargs"), _CASES, ids=[c[0].__name__ for c in _CASES])
def test_a_functional_optimizer_steps_as_torch_optim_does(cls: type, functional: dict, optim_kwargs: dict) -> None:
    start, grads = _start()
    ours = [p.clone() for p in start]
    theirs = [p.clone().requires_grad_() for p in start]
    for p in ours:
        p.grad = torch.full_like(p, 1e6)  # what a trainer's backward left there: the step must not use it
    f = as_functional_optim(cls, **functional)
    f.param_group["params"].extend(ours)
    reference = cls(theirs, **optim_kwargs, foreach=False)
    for step, gradients in enumerate(grads):
        if step == 2:  # a new learning rate reaches the next steps, as in torch
            f.defaults["lr"] *= 0.5
            reference.param_groups[0]["lr"] *= 0.5
        f.step(gradients)
        for p, g in zip(theirs, gradients, strict=True):
            p.grad = g
        reference.step()
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            torch.testing.assert_close(a, b.detach(), msg=lambda m, s=step, i=i: f"step {s}, param {i}: {m}")
    assert all(torch.equal(p.grad, torch.full_like(p, 1e6)) for p in ours)  # and it stays as it was


def _step_both(f: Any, reference: torch.optim.Optimizer, ours: list[torch.Tensor], theirs: list[torch.Tensor],
               grads: list[list[torch.Tensor | None]]) -> None:
    """Step the functional optimizer and torch.optim's with the same gradients; the parameters after each step
    must agree."""
    for step, gradients in enumerate(grads):
        f.step(gradients)
        for p, g in zip(theirs, gradients, strict=True):
            p.grad = g
        reference.step()
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            torch.testing.assert_close(a, b.detach(), msg=lambda m, s=step, i=i: f"step {s}, param {i}: {m}")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's functional optimizers are TorchScript's
def test_switches_set_after_construction_reach_the_next_steps_as_in_torch() -> None:
    from torch.distributed.optim import as_functional_optim as torch_as_functional_optim

    start, grads = _start()
    ours, torch_functional = [p.clone() for p in start], [p.clone() for p in start]
    theirs = [p.clone().requires_grad_() for p in start]
    f = as_functional_optim(torch.optim.SGD, 0.1, momentum=0.9)
    t = torch_as_functional_optim(torch.optim.SGD, 0.1, momentum=0.9)
    f.param_group["params"].extend(ours)
    for functional in (f, t):  # torch's functional optimizers read these attributes at each step
        functional.maximize, functional.nesterov, functional.foreach = True, True, True
    reference = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, maximize=True, nesterov=True, foreach=True)
    _step_both(f, reference, ours, theirs, grads)
    for gradients in grads:
        for p, g in zip(torch_functional, gradients, strict=True):
            if g is not None:  # torch's step_param fails given None
                t.step_param(p, g)
    for a, b in zip(ours, torch_functional, strict=True):
        torch.testing.assert_close(a, b)


def test_adagrad_steps_a_parameter_that_is_not_a_leaf() -> None:
    start, grads = _start()
    leaves = [p.clone().requires_grad_() for p in start]
    ours = [leaf * 1.0 for leaf in leaves]  # outputs of autograd ops: torch.optim would refuse them
    assert not any(p.is_leaf for p in ours)
    theirs = [p.clone().requires_grad_() for p in start]
    f = as_functional_optim(torch.optim.Adagrad, 0.1, initial_accumulator_value=0.5)
    f.param_group["params"].extend(ours)
    _step_both(f, torch.optim.Adagrad(theirs, lr=0.1, initial_accumulator_value=0.5, foreach=False), ours, theirs,
               grads)
    assert len(f.state) == len(ours)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's functional optimizers are TorchScript's
@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_step_param_steps_one_parameter_as_torch_s_functional_optimizer_does(cls: type) -> None:
    from torch.distributed.optim import as_functional_optim as torch_as_functional_optim

    start, grads = _start()
    ours, theirs = [p.clone() for p in start], [p.clone() for p in start]
    f = as_functional_optim(cls, 0.01, weight_decay=0.1)
    t = torch_as_functional_optim(cls, 0.01, weight_decay=0.1)
    for gradients in grads:
        for a, b, g in zip(ours, theirs, gradients, strict=True):
            if g is not None:  # torch's fail given None
                f.step_param(a, g)
                t.step_param(b, g)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.equal(ours[0], start[0])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_functional_optimizers_refuse_what_torch_s_refuse() -> None:
    from torch.distributed.optim import as_functional_optim as torch_as_functional_optim

    with pytest.raises(ValueError, match=r"LBFGS.*does not have a functional counterpart"):
        as_functional_optim(torch.optim.LBFGS, lr=0.1)
    with pytest.raises(ValueError):
        torch_as_functional_optim(torch.optim.LBFGS, lr=0.1)
    f = as_functional_optim(torch.optim.SGD, 0.1)
    f.param_group["params"].append(torch.zeros(2))
    with pytest.raises(ValueError, match=r"Params length: 1\. Gradients length: 2"):
        f.step([torch.ones(2), torch.ones(2)])
    with pytest.raises(ValueError, match=r"Invalid beta parameter at index 0: 1\.5"):
        as_functional_optim(torch.optim.Adam, betas=(1.5, 0.9))
    with pytest.raises(TypeError):
        as_functional_optim(torch.optim.SGD, differentiable=True)  # torch.optim's, not the functional one's
