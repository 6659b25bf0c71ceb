"""torch.distributed's API under shoal's names: the same calls, made through `shoal.distributed` and through
`torch.distributed` (gloo) on the same real ranks, leave the same results; what torch's gloo cannot do
(split_group, shrink_group) is checked against what it must give. And every public name of torch's module
is ours, with torch's parameters (what ../shared/tools/surface.py measures)."""

from __future__ import annotations

import importlib
import inspect
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ranks import run_ranks
from tests.reference import same


def _tensors(rank: int, world: int, dist: Any) -> dict[str, Any]:
    """The tensor collectives torch added beside the list forms, with group ranks for roots."""
    got: dict[str, Any] = {}
    out = torch.empty(world * 3)
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank)) + torch.arange(3.0))
    got["all_gather_into_tensor"] = out
    stacked = torch.arange(world * 4, dtype=torch.float64) * (rank + 1)
    mine = torch.empty(4, dtype=torch.float64)
    dist.reduce_scatter_tensor(mine, stacked, op=dist.ReduceOp.MAX)
    got["reduce_scatter_tensor"] = mine
    sends = [r + 1 for r in range(world)]  # rank r gets r + 1 rows from everyone
    receives = [rank + 1] * world
    rows = torch.arange(sum(sends) * 2, dtype=torch.int64).reshape(-1, 2) + 100 * rank
    into = torch.empty(sum(receives), 2, dtype=torch.int64)
    dist.all_to_all_single(into, rows, receives, sends)
    got["all_to_all_single"] = into
    lists = [[torch.empty(2), torch.empty(5)] for _ in range(world)]
    dist.all_gather_coalesced(lists, [torch.full((2,), rank + 0.5), torch.arange(5.0) * rank])
    got["all_gather_coalesced"] = lists
    root = torch.full((2,), float(rank))
    dist.broadcast(root, group_src=world - 1)
    got["broadcast group_src"] = root
    gathered = [torch.empty(2) for _ in range(world)] if rank == 1 else None
    dist.gather(torch.full((2,), rank * 2.0), gathered, group_dst=1)
    got["gather group_dst"] = gathered
    work = dist.barrier(async_op=True)
    work.wait()
    dist.barrier(timeout=timedelta(seconds=30))
    return got


def _point_to_point(rank: int, world: int, dist: Any) -> dict[str, Any]:
    """A ring of batched sends and receives, and lists of objects from one rank to the next."""
    got: dict[str, Any] = {}
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = torch.empty(3)
    ops = [dist.P2POp(dist.isend, torch.full((3,), float(rank)), right),
           dist.P2POp(dist.irecv, incoming, group_peer=left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    got["batch_isend_irecv"] = incoming
    if rank == 0:
        dist.send_object_list([{"from": 0}, "text", torch.arange(3)], dst=1)
    elif rank == 1:
        objects = [None, None, None]
        got["recv_object_list sender"] = dist.recv_object_list(objects, src=0)
        got["recv_object_list"] = objects
    return got


def _groups(rank: int, world: int, dist: Any) -> dict[str, Any]:
    """Subgroups and the translation between their ranks and the job's."""
    got: dict[str, Any] = {}
    tail = dist.new_group(list(range(1, world)))
    got["outside is NON_GROUP_MEMBER"] = tail == dist.GroupMember.NON_GROUP_MEMBER
    got["rank in tail"] = dist.get_rank(tail)
    got["size of tail"] = dist.get_world_size(tail)
    if rank > 0:
        got["tail ranks"] = dist.get_process_group_ranks(tail)
        got["global of group rank 0"] = dist.get_global_rank(tail, 0)
        got["group rank of me"] = dist.get_group_rank(tail, rank)
        t = torch.ones(2) * rank
        dist.all_reduce(t, group=tail)
        got["all_reduce in tail"] = t
    with pytest.warns(UserWarning):
        skipped = dist.all_reduce(torch.ones(1), group=tail) if rank == 0 else _warned()
    got["non-member call"] = skipped
    mine, every = dist.new_subgroups_by_enumeration([[r] for r in range(0, world, 2)] +
                                                    [[r for r in range(1, world, 2)]])
    got["subgroups"] = len(every)
    got["my subgroup's ranks"] = dist.get_process_group_ranks(mine) if mine is not None else None
    pair, pairs = dist.new_subgroups(group_size=1)
    got["new_subgroups"] = (len(pairs), dist.get_world_size(pair))
    got["WORLD is the default group"] = dist.get_world_size(dist.group.WORLD) == world
    dist.barrier()
    return got


def _differentiable(rank: int, world: int, dist: Any) -> dict[str, Any]:
    """torch.distributed.nn's collectives: each output and the gradient it sends back to this rank's input."""
    import importlib

    nn = importlib.import_module("shoal.nn" if dist.__name__.startswith("shoal") else "torch.distributed.nn")
    got: dict[str, Any] = {}
    weights = torch.arange(1.0, 4.0) * (rank + 1)  # a loss that differs per rank and per element

    def run(name: str, fn, *inputs: torch.Tensor, defined: bool = True) -> None:
        """`defined`: whether this rank's output is defined (a reduce's is on its destination only: gloo
        leaves its scratch in the others)."""
        inputs = [t.clone().requires_grad_() for t in inputs]
        outputs = fn(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        loss = sum((o * weights[: o.shape[-1]] * (i + 1)).sum() for i, o in enumerate(outputs))
        loss.backward()
        got[name] = ([o.detach() for o in outputs] if defined else None, [t.grad for t in inputs])

    x = torch.arange(3.0) + rank
    run("broadcast", lambda t: nn.broadcast(t, src=world - 1), x)
    run("reduce", lambda t: nn.reduce(t, dst=0), x, defined=rank == 0)
    run("all_reduce", lambda t: nn.all_reduce(t), x)
    run("all_reduce avg", lambda t: nn.all_reduce(t, op=dist.ReduceOp.AVG), x)
    run("all_gather", lambda t: nn.all_gather(t), x)
    run("gather", lambda t: nn.gather(t, dst=1), x)
    run("scatter", lambda *ts: nn.scatter(ts, src=0), *[x * (r + 2) for r in range(world)])
    run("reduce_scatter", lambda *ts: nn.reduce_scatter(torch.empty(3), ts),
        *[x * (r + 1) for r in range(world)])
    run("all_to_all", lambda *ts: nn.all_to_all([torch.empty(3) for _ in range(world)], ts),
        *[x + 10 * r for r in range(world)])
    run("all_to_all_single", lambda t: nn.all_to_all_single(torch.empty(world, 3), t),
        torch.arange(world * 3.0).reshape(world, 3) * (rank + 1))
    return got


def _warned() -> None:
    import warnings

    warnings.warn("members call the collective; this rank stands in for the warning", UserWarning, stacklevel=1)


FAMILIES = (_tensors, _point_to_point, _groups, _differentiable)


def _shoal_and_torch(rank: int, world: int, torch_port: int) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch.distributed as torch_dist

    import shoal.distributed as dist

    ours = {f.__name__: f(rank, world, dist) for f in FAMILIES}
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=world)
    try:
        theirs = {f.__name__: f(rank, world, torch_dist) for f in FAMILIES}
    finally:
        torch_dist.destroy_process_group()
    return ours, theirs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shoal_distributed_leaves_what_torch_distributed_leaves(world: int) -> None:
    from shoal.ports import free_port

    outcomes = run_ranks(_shoal_and_torch, world, free_port(), timeout=120)
    for rank, (ours, theirs) in outcomes.items():
        for family in ours:
            for name in ours[family]:
                assert same(ours[family][name], theirs[family][name]), \
                    f"rank {rank}, {name}: shoal {ours[family][name]!r} torch {theirs[family][name]!r}"
        assert ours["_groups"]["outside is NON_GROUP_MEMBER"] == (rank == 0)
    assert outcomes[1][0]["_point_to_point"]["recv_object_list"][0] == {"from": 0}


def _split_and_shrink(rank: int, world: int) -> dict[str, Any]:
    """split_group (group ranks of the parent), and what only some ranks call: new_group with
    use_local_synchronization (torch's gloo hangs making one) and shrink_group (NCCL's only, in torch)."""
    import shoal.distributed as dist

    halves = dist.split_group(split_ranks=[[0, 1], [2, 3]])
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=halves)
    got = {"split": dist.get_process_group_ranks(halves), "sum in half": t.item()}
    if rank in (1, 3):  # only the members call it
        local = dist.new_group([1, 3], use_local_synchronization=True)
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=local)
        got["use_local_synchronization"] = t.item()
    everyone = dist.new_group(list(range(world)))
    with pytest.raises(ValueError, match="shrinks subgroups only"):
        dist.shrink_group([3])
    if rank != 3:
        smaller = dist.shrink_group([3], group=everyone)
        t = torch.tensor([1.0])
        dist.all_reduce(t, group=smaller)
        got["shrunk"] = (dist.get_process_group_ranks(smaller), t.item())
    return got


def test_split_group_local_groups_and_shrink_group_make_the_groups_they_name() -> None:
    out = run_ranks(_split_and_shrink, 4, timeout=90)
    assert [out[r]["split"] for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [out[r]["sum in half"] for r in range(4)] == [1.0, 1.0, 5.0, 5.0]
    assert all(out[r]["shrunk"] == ([0, 1, 2], 3.0) for r in range(3)) and "shrunk" not in out[3]
    assert [out[r].get("use_local_synchronization") for r in range(4)] == [None, 6.0, None, 6.0]


def _with_store(rank: int, world: int, port: int, kind: str, path: str) -> float:
    """init_process_group given one of torch's stores, a file:// init_method, or a scheme with a handler."""
    import torch.distributed as torch_dist

    import shoal.distributed as dist

    if kind == "TCPStore":
        store = torch_dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=30))
        dist.init_process_group(store=store, rank=rank, world_size=world)
    elif kind == "file":
        dist.init_process_group(init_method=f"file://{path}", rank=rank, world_size=world)
    else:  # a scheme of the script's own, its handler written as torch's are: rank and size in the query
        def files(url: str, **kwargs: Any):
            query = dict(pair.split("=") for pair in url.partition("?")[2].split("&"))
            yield torch_dist.FileStore(path, int(query["world_size"])), int(query["rank"]), int(query["world_size"])

        dist.register_rendezvous_handler("myfiles", files)
        dist.init_process_group(init_method="myfiles://anywhere", rank=rank, world_size=world)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("kind", ["TCPStore", "file", "handler"])
def test_init_process_group_takes_torch_stores_and_file_urls(kind: str, tmp_path: Path) -> None:
    out = run_ranks(_with_store, 3, kind, str(tmp_path / "rendezvous"), backend=None, timeout=60)
    assert out == {0: 6.0, 1: 6.0, 2: 6.0}


def test_monitored_barrier_names_the_rank_that_did_not_come_and_a_late_one_spoils_no_later_barrier() -> None:
    out = run_ranks(_monitored, 3, timeout=60)
    assert "rank(s) [2] did not reach the barrier" in out[0][0]
    assert all("did not release global rank" in out[r][0] for r in (1, 2))
    assert [out[r][1] for r in range(3)] == ["passed"] * 3


def _monitored(rank: int, world: int) -> list[str]:
    """Rank 2 comes to the first monitored barrier only after the others have given up on it: rank 0 names
    it, and ranks 1 and 2, never released, say so. Rank 2's late arrival there does not count for the
    second barrier, which every rank reaches."""
    import shoal.distributed as dist

    outcomes = []
    if rank == 2:
        dist.all_reduce(torch.ones(1))  # returns once the others are done with the first barrier
    for patience in (2, 20):
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=patience), wait_all_ranks=True)
            outcomes.append("passed")
        except RuntimeError as exc:
            outcomes.append(str(exc))
        if rank != 2 and len(outcomes) == 1:
            dist.all_reduce(torch.ones(1))
    return outcomes


def _patient_barrier(rank: int, world: int) -> bool:
    """The group's timeout is 2 s; a barrier given 30 s waits out rank 1's 4 s of work."""
    import time

    import shoal.distributed as dist

    if rank == 1:
        time.sleep(4)
    dist.barrier(timeout=timedelta(seconds=30))
    alone = dist.new_group([0])
    answers = dist.get_rank(alone) == (0 if rank == 0 else -1)
    if rank == 1:
        with pytest.warns(UserWarning, match="not a member"):
            answers &= dist.recv(torch.empty(1), src=0, group=alone) == -1  # torch's answer outside the group
    dist.destroy_process_group(alone)  # on rank 1, a group it is not in: nothing to do, as in torch
    return answers


def test_a_barrier_s_timeout_replaces_the_group_s_and_non_members_are_answered_as_torch_answers() -> None:
    assert run_ranks(_patient_barrier, 2, group_timeout=2, timeout=60) == {0: True, 1: True}


def test_a_lost_peer_is_caught_as_torch_s_dist_backend_error() -> None:
    from shoal.errors import PeerFailure

    assert issubclass(PeerFailure, torch.distributed.DistBackendError)
    try:
        raise PeerFailure(3, "connection reset")
    except torch.distributed.DistBackendError as exc:
        assert exc.rank == 3


def _public(module: Any) -> list[str]:
    names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    return sorted(n for n in names if not n.startswith("_") and not inspect.ismodule(getattr(module, n, None)))


def _parameters(obj: Any) -> list[str] | None:
    try:
        return list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return None


# torch's names that do not apply to shoal, each with its reason in docs/comm.md ("Names that do not apply").
NOT_APPLICABLE = {"torch.distributed.rpc": {"AllGatherStates", "method_factory", "new_method"}}


@pytest.mark.filterwarnings("ignore::FutureWarning")  # looking up torch's deprecated `reduce_op` warns
@pytest.mark.parametrize(("theirs", "ours"), [
    ("torch.distributed", "shoal.distributed"), ("torch.distributed.nn", "shoal.nn"),
    ("torch.distributed.autograd", "shoal.autograd"), ("torch.distributed.rpc", "shoal.rpc"),
    ("torch.multiprocessing", "shoal.multiprocessing"), ("torch.distributed.pipelining", "shoal.pipeline"),
    ("torch.distributed.optim", "shoal.optim"), ("torch.distributed.algorithms", "shoal.parallel")])
def test_every_public_name_of_torch_s_module_is_ours_with_its_parameters(theirs: str, ours: str) -> None:
    torch_module, shoal_module = importlib.import_module(theirs), importlib.import_module(ours)
    names = [n for n in _public(torch_module) if hasattr(torch_module, n)]  # torch's rpc lists some it lacks
    missing = [n for n in names if not hasattr(shoal_module, n) and n not in NOT_APPLICABLE.get(theirs, ())]
    assert not missing, f"{ours} lacks {missing}"
    differ = {n: (_parameters(getattr(torch_module, n)), _parameters(getattr(shoal_module, n)))
              for n in names if hasattr(shoal_module, n)}
    differ = {n: pair for n, pair in differ.items() if None not in pair and pair[0] != pair[1]}
    assert not differ, f"parameters differ from torch's (torch's, ours): {differ}"
