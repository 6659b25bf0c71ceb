"""ZeroRedundancyOptimizer against torch's: on the same real ranks, shoal's (on a "shoal" group) and torch's (on
gloo) train the same model, each rank on its own data, to the same parameters after every step, with SGD with
momentum and Adam, with and without parameters_as_bucket_view, across add_param_group; each rank holds the
optimizer state of the parameters torch's rank holds, and no other; the consolidated state dicts are torch's;
a run resumed from one goes on as the uninterrupted run; under DistributedDataParallel it trains as a plain
optimizer does, and on a subgroup it trains and saves as one plain Adam; under Join with uneven inputs it ends
where torch's DDP + ZeRO + Join end. Errors are torch's. Every multi-process check of a world size is in one run."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from shoal.optim import ZeroRedundancyOptimizer
from shoal.optim.zero import partition_parameters
from tests.ranks import run_ranks

# The last layer joins the optimizer at step ADD; the state is saved after step SAVE; the first layer's bias is
# frozen at step FREEZE (the buckets are rebuilt without it).
STEPS, ADD, SAVE, FREEZE = 6, 2, 3, 4
OPTIMS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), "adam": (torch.optim.Adam, {"lr": 0.01})}
CONFIGS = [(name, bucket_view) for name in OPTIMS for bucket_view in (False, True)]
JOIN_CONFIGS = [("sgd", False), ("adam", True)]


def _model(last_trains: bool) -> nn.Sequential:
    """Linear layers of different sizes; the last one frozen until it is added to the optimizer."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4), nn.Tanh(),
                        nn.Linear(4, 3)).double()
    net[6].requires_grad_(last_trains)
    return net


def _groups(net: nn.Sequential, with_last: bool) -> list[dict[str, Any]]:
    """Lists, not generators: torch's ZeroRedundancyOptimizer takes a group's generator to count its parameters
    and then builds the group from what is left of it (nothing)."""
    groups = [{"params": [*net[0].parameters()]}, {"params": [*net[2].parameters(), *net[4].parameters()],
                                                    "lr": 0.05}]
    return [*groups, _last_group(net)] if with_last else groups


def _last_group(net: nn.Sequential) -> dict[str, Any]:
    return {"params": [*net[6].parameters()], "lr": 0.02}


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank its own data: the shard a rank steps is stepped with its owner's gradients."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 6, generator=gen, dtype=torch.float64), torch.randn(5, 3, generator=gen, dtype=torch.float64)


def _params(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def _owned(zero: Any) -> tuple[list[int], int]:
    """The global indices of the parameters this rank's local optimizer holds state for, and its elements."""
    index = {p: i for i, p in enumerate(p for g in zero.param_groups for p in g["params"])}
    held = sorted(index[p] for p, state in zero.optim.state.items() if state)
    numel = sum(t.numel() for state in zero.optim.state.values() for t in state.values() if torch.is_tensor(t))
    return held, numel


def _error(fn: Any) -> tuple[str, str] | None:
    try:
        fn()
    except (RuntimeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return None


@dataclass
class _Impl:
    """One side's classes: shoal's or torch's."""

    zero: type
    ddp: type
    join: type


def _train(impl: _Impl, rank: int, world: int, name: str, bucket_view: bool) -> dict[str, Any]:
    """STEPS steps on this rank's data; the last layer added at step ADD; the state consolidated to rank 0 after
    step SAVE and, at the end, to the last rank."""
    optim_class, defaults = OPTIMS[name]
    net = _model(last_trains=False)
    zero = impl.zero(_groups(net, with_last=False), optim_class, parameters_as_bucket_view=bucket_view, **defaults)
    out: dict[str, Any] = {"unconsolidated": _error(zero.state_dict), "snapshots": []}
    for step in range(STEPS):
        if step == ADD:
            net[6].requires_grad_(True)
            zero.add_param_group(_last_group(net))
        net[0].bias.requires_grad_(step < FREEZE)
        zero.zero_grad()
        x, y = _batch(rank, step)
        nn.functional.mse_loss(net(x), y).backward()
        zero.step()
        out["snapshots"].append(_params(net))
        if step == SAVE:
            zero.consolidate_state_dict()
            out["saved"] = copy.deepcopy(zero.state_dict()) if rank == 0 else None  # as torch.save would keep it
    out["owned"] = _owned(zero)
    out["local groups"] = len(zero.optim.param_groups)
    zero.consolidate_state_dict(to=world - 1)
    out["final state"] = zero.state_dict() if rank == world - 1 else _error(zero.state_dict)
    if rank == world - 1:  # a copy: torch's load_state_dict changes the dict it is given
        wrong = {**copy.deepcopy(out["final state"]), "param_groups": []}
        out["wrong groups"] = _error(lambda: zero.load_state_dict(wrong))
    return out


def _resume(rank: int, name: str, bucket_view: bool, params: list[torch.Tensor], saved: dict) -> dict[str, Any]:
    """A fresh model and optimizer from the parameters and state dict saved after step SAVE, trained on."""
    optim_class, defaults = OPTIMS[name]
    net = _model(last_trains=True)
    with torch.no_grad():
        for p, value in zip(net.parameters(), params, strict=True):
            p.copy_(value)
    zero = ZeroRedundancyOptimizer(_groups(net, with_last=True), optim_class, parameters_as_bucket_view=bucket_view,
                                   **defaults)
    zero.load_state_dict(saved)
    out: dict[str, Any] = {"owned": _owned(zero)[0]}
    zero.consolidate_state_dict(to=0)
    out["reloaded"] = zero.state_dict() if rank == 0 else None
    snapshots = []
    for step in range(SAVE + 1, STEPS):
        net[0].bias.requires_grad_(step < FREEZE)
        zero.zero_grad()
        x, y = _batch(rank, step)
        nn.functional.mse_loss(net(x), y).backward()
        zero.step()
        snapshots.append(_params(net))
    out["snapshots"] = snapshots
    return out


def _ddp_steps(impl: _Impl, rank: int, name: str, bucket_view: bool | None, batches: int,
               join: bool) -> list[list[torch.Tensor]]:
    """DDP (every layer trains) with ZeRO, or with the plain optimizer (bucket_view None), for `batches` steps,
    under Join([ddp, zero]) if `join`; the parameters after each step, then after the join."""
    optim_class, defaults = OPTIMS[name]
    net = _model(last_trains=True)
    ddp = impl.ddp(net)
    if bucket_view is None:
        opt = optim_class(_groups(net, with_last=True), **defaults)
    else:
        opt = impl.zero(_groups(net, with_last=True), optim_class, parameters_as_bucket_view=bucket_view, **defaults)
    snapshots = []
    with impl.join([ddp, opt] if bucket_view is not None else [ddp], enable=join):
        for step in range(batches):
            opt.zero_grad()
            x, y = _batch(rank, step)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            snapshots.append(_params(net))
    return [*snapshots, _params(net)]


def _zero_alone(rank: int) -> list[torch.Tensor]:
    """The optimizer as the only Joinable, uneven inputs and no DDP (torch's hangs: its joined rank's hook
    notifies the join context as a live rank would); the parameters after the join."""
    from shoal.parallel import Join

    net = _model(last_trains=True)
    zero = ZeroRedundancyOptimizer(_groups(net, with_last=True), torch.optim.SGD, lr=0.1, momentum=0.9)
    with Join([zero]):
        for step in range(2 + rank):
            zero.zero_grad()
            x, y = _batch(rank, step)
            nn.functional.mse_loss(net(x), y).backward()
            zero.step()
    return _params(net)


def _subgroup(rank: int, world: int) -> dict[str, Any] | None:
    """On the subgroup of global ranks 1.., every member on the same data: the optimizer steps as one plain Adam
    does, and its state dict, consolidated to the last member (group rank and global rank differ), is that
    Adam's."""
    import shoal.distributed as dist

    members = list(range(1, world))
    group = dist.new_group(members)
    if rank not in members:
        return None
    sharded, plain = _model(last_trains=True), _model(last_trains=True)
    zero = ZeroRedundancyOptimizer(_groups(sharded, with_last=True), torch.optim.Adam, process_group=group,
                                   parameters_as_bucket_view=True, lr=0.01)
    adam = torch.optim.Adam(_groups(plain, with_last=True), lr=0.01)
    for step in range(3):
        x, y = _batch(0, step)
        for net, opt in ((sharded, zero), (plain, adam)):
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    zero.consolidate_state_dict(to=len(members) - 1)
    return {"params": (_params(sharded), _params(plain)), "owned": _owned(zero)[0],
            "state": (zero.state_dict(), adam.state_dict()) if rank == members[-1] else None}


def _side(impl: _Impl, rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"train": {config: _train(impl, rank, world, *config) for config in CONFIGS}}
    out["join"] = {config: _ddp_steps(impl, rank, *config, batches=3 + rank, join=True) for config in JOIN_CONFIGS}
    return out


def _ranks(rank: int, world: int, torch_port: int) -> dict[str, Any]:
    """shoal's side on the "shoal" group run_ranks made (with the resumed runs and the plain optimizer), then
    torch's on a gloo group in the same processes."""
    import torch.distributed as torch_dist
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    import shoal.distributed as dist
    from shoal.parallel import DistributedDataParallel, Join

    out = {"shoal": _side(_Impl(ZeroRedundancyOptimizer, DistributedDataParallel, Join), rank, world)}
    out["resumed"] = {}
    for config, trained in out["shoal"]["train"].items():
        saved = [copy.deepcopy(trained["saved"])]  # loaded, its tensors become the optimizer's (as in torch)
        dist.broadcast_object_list(saved, src=0)
        out["resumed"][config] = _resume(rank, *config, trained["snapshots"][SAVE], saved[0])
    out["plain"] = {config: [_ddp_steps(_Impl(ZeroRedundancyOptimizer, DistributedDataParallel, Join), rank,
                                        config[0], view, STEPS, join=False) for view in (config[1], None)]
                    for config in JOIN_CONFIGS}
    out["alone"] = _zero_alone(rank)
    out["subgroup"] = _subgroup(rank, world)
    net = _model(last_trains=True)
    zero = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    out["bad target"] = _error(lambda: zero.consolidate_state_dict(to=world))
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=world)
    try:
        out["torch"] = _side(_Impl(TorchZero, nn.parallel.DistributedDataParallel, TorchJoin), rank, world)
    finally:
        torch_dist.destroy_process_group()
    return out


def _close(a: Any, b: Any, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("world", [2, 3])
def test_zero_trains_shards_and_saves_as_torch_s_does(world: int) -> None:
    from shoal.ports import free_port

    out = run_ranks(_ranks, world, free_port(), timeout=300, group_timeout=120)
    for rank in range(world):
        ours, theirs = out[rank]["shoal"], out[rank]["torch"]
        for config in CONFIGS:
            what = f"rank {rank}, {config}"
            mine, torch_s = ours["train"][config], theirs["train"][config]
            assert mine["unconsolidated"] == torch_s["unconsolidated"]
            for step in range(STEPS):
                _close(mine["snapshots"][step], torch_s["snapshots"][step], f"{what}, step {step}")
            # The shard: the parameters whose optimizer state this rank holds are those torch's rank holds.
            assert mine["owned"] == torch_s["owned"], what
            assert mine["local groups"] == torch_s["local groups"] == 3, what
            if rank == 0:
                _close(mine["saved"], torch_s["saved"], f"{what}, state dict after step {SAVE}")
            if rank == world - 1:
                _close(mine["final state"], torch_s["final state"], f"{what}, final state dict")
                assert mine["wrong groups"] == torch_s["wrong groups"] == (
                    "ValueError", "loaded state dict has a different number of parameter groups"), what
            else:  # consolidated elsewhere: torch's error, naming this rank
                assert mine["final state"] == torch_s["final state"], what
                assert f"consolidate_state_dict(to={rank})" in mine["final state"][1], what
            # Resumed from the state dict saved after step SAVE, the run goes on as the uninterrupted one, and the
            # state dict it gives back is the one it loaded.
            resumed = out[rank]["resumed"][config]
            for i, step in enumerate(range(SAVE + 1, STEPS)):
                _close(resumed["snapshots"][i], mine["snapshots"][step], f"{what}, resumed, step {step}")
            if rank == 0:
                _close(resumed["reloaded"], mine["saved"], f"{what}, state dict after loading")
        for config in JOIN_CONFIGS:
            _close(ours["join"][config], theirs["join"][config], f"rank {rank}, {config} under Join")
            with_zero, plain = out[rank]["plain"][config]
            _close(with_zero, plain, f"rank {rank}, {config}: DDP with ZeRO against DDP with the plain optimizer")
        assert out[rank]["bad target"] == (
            "ValueError", f"consolidate_state_dict: to={world} is not a rank of this group of {world}")
    for config in CONFIGS:
        # Each rank holds state for its shard only: the shards are disjoint, cover every parameter, and each is
        # smaller than the whole; the state dicts hold all of it.
        held = [out[rank]["shoal"]["train"][config]["owned"] for rank in range(world)]
        indices = sorted(i for owned, _ in held for i in owned)
        assert indices == list(range(8)), f"{config}: shards {held}"
        total = sum(numel for _, numel in held)
        assert all(0 < numel < total for _, numel in held), f"{config}: state elements per rank {held}"
        state = out[world - 1]["shoal"]["train"][config]["final state"]["state"]
        assert sorted(state) == list(range(8))
        assert sum(t.numel() for s in state.values() for t in s.values() if torch.is_tensor(t)) == total
        for rank in range(world):
            assert out[rank]["resumed"][config]["owned"] == held[rank][0], f"{config}: rank {rank} after loading"
    # What makes the comparisons telling: the ranks' data differ, yet the broadcasts leave every replica the same
    # after every step; and the uneven runs joined at different steps.
    for config in CONFIGS:
        for step in range(STEPS):
            ours = [out[r]["shoal"]["train"][config]["snapshots"][step] for r in range(world)]
            assert all(torch.equal(a, b) for r in range(1, world) for a, b in zip(ours[0], ours[r], strict=True)), \
                f"{config}: replicas differ after step {step}"
    assert [len(out[r]["shoal"]["join"][JOIN_CONFIGS[0]]) for r in range(world)] == [4 + r for r in range(world)]
    assert out[0]["subgroup"] is None
    for r in range(1, world):
        sub = out[r]["subgroup"]
        _close(*sub["params"], f"rank {r}: on a subgroup, against a plain Adam")
        if r == world - 1:
            _close(*sub["state"], f"rank {r}: on a subgroup, the state dict against a plain Adam's")
    assert sorted(i for r in range(1, world) for i in out[r]["subgroup"]["owned"]) == list(range(8))
    for r in range(1, world):
        _close(out[r]["alone"], out[0]["alone"], f"rank {r}'s model after a join of the optimizer alone")
        _close(out[r]["shoal"]["join"][JOIN_CONFIGS[0]][-1], out[0]["shoal"]["join"][JOIN_CONFIGS[0]][-1],
               f"rank {r}'s model after the join")


# ---- in one process: what needs no group ------------------------------------------------------------------

def test_the_partition_is_torch_s_sorted_greedy_one() -> None:
    sizes = [[10, 3, 7], [7, 1, 12]]  # two groups: largest first, each to the least-loaded rank so far
    groups = [{"params": [torch.zeros(n) for n in group], "lr": i} for i, group in enumerate(sizes)]
    per_rank = partition_parameters(groups, 2)
    numels = [[[p.numel() for p in group["params"]] for group in rank] for rank in per_rank]
    # 10 -> r0, 7 -> r1, 3 -> r1 (7 < 10); then 12 -> r0 (10 = 10: the first), 7 -> r1, 1 -> r1 (17 < 22).
    assert numels == [[[10], [12]], [[7, 3], [7, 1]]]
    assert [[group["lr"] for group in rank] for rank in per_rank] == [[0, 1], [0, 1]]
    assert partition_parameters(groups, 3)[2][0]["params"][0].numel() == 3  # 10, 7, 3 each to an empty rank


def test_bad_arguments_raise_torch_s_errors_before_any_collective() -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.distributed.optim.functional_sgd import _FunctionalSGD

    weight, half = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, dtype=torch.float16))
    for params, error, match in [(weight, TypeError, "should be an iterable of Tensors"),
                                 ([], ValueError, "got an empty parameter list"),
                                 ([weight, half], ValueError, "same dense type"),
                                 ([{"lr": 1.0}], ValueError, "must have a 'params' key"),
                                 ([weight, {"params": [half]}], TypeError, "iterable of Tensors or dicts")]:
        with pytest.raises(error, match=match):
            ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
        with pytest.raises(error):
            TorchZero(params, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="named parameters"):
        ZeroRedundancyOptimizer([{"params": [("w", weight)]}], torch.optim.SGD, lr=0.1)
    with pytest.raises(NotImplementedError, match="overlap_with_ddp=False"):
        ZeroRedundancyOptimizer([weight], torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    with pytest.raises(ValueError, match="functional optimizer"):
        ZeroRedundancyOptimizer([weight], _FunctionalSGD, lr=0.1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ZeroRedundancyOptimizer([weight], torch.optim.SGD, lr=0.1)  # no group to shard over
