"""Asynchronous ops run in the background in issue order; point-to-point matching by source and tag;
subgroups; on both backends where the behaviour is ours to promise."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch

import shoal
import shoal.distributed as dist
from tests.ranks import run_ranks


def _overlap(rank: int, world: int) -> list[float]:
    store = dist.default_group().store
    if rank == 1:  # joins only once rank 0 has computed while its all-reduce was in flight
        store.wait(["computed"], timeout=timedelta(seconds=30))
    tensor = torch.full((8_000_000,), float(rank + 1))
    work = dist.all_reduce(tensor, async_op=True)
    a = torch.tanh(torch.randn(64, 64))  # compute goes on while the all-reduce is in flight
    if rank == 0:
        store.set("computed", True)
    while not work.is_completed():
        a = torch.tanh(a @ a)
    assert work.wait() and work.exception() is None
    return tensor.unique().tolist()  # the values the sum came out as


@pytest.mark.parametrize("backend", ["shoal", "gloo"])
def test_async_all_reduce_returns_at_once_and_completes_in_the_background(backend: str) -> None:
    # A blocking async_op would wait for rank 1, which waits for rank 0's first step: the test times out.
    out = run_ranks(_overlap, 2, backend=backend, group_timeout=20)
    assert out == {0: [3.0], 1: [3.0]}  # 1 + 2 everywhere


def _issue_order(rank: int, world: int) -> list[float]:
    big = torch.full((1_000_000,), float(rank + 1), dtype=torch.float64)
    small = torch.full((7,), float(rank + 1), dtype=torch.float64)
    works = []
    for i in range(4):
        # Alternate big and small ops on the same tensors: a later small op overtaking an earlier
        # big one would change the result, since SUM and PRODUCT do not commute as steps.
        op = dist.ReduceOp.SUM if i % 2 == 0 else dist.ReduceOp.PRODUCT
        works.append(dist.all_reduce(big, op=op, async_op=True))
        works.append(dist.all_reduce(small, op=op, async_op=True))
        works.append(dist.broadcast(small, src=i % world, async_op=True))
    for work in reversed(works):
        work.wait()
    return [big[0].item(), big[-1].item(), small[0].item()]


def _expected_order(world: int) -> list[float]:
    big = [float(r + 1) for r in range(world)]
    small = list(big)
    for i in range(4):
        combine = sum if i % 2 == 0 else math.prod
        big = [combine(big)] * world
        small = [combine(small)] * world
        small = [small[i % world]] * world
    return [big[0], big[0], small[0]]


def test_async_ops_complete_in_issue_order() -> None:
    # Only "shoal" promises this: gloo runs async ops on a pool of threads, so two ops on one tensor race.
    out = run_ranks(_issue_order, 3)
    for values in out.values():
        assert values == _expected_order(3)


def _point_to_point(rank: int, world: int, backend: str) -> None:
    # gloo's send waits for the matching receive, so the out-of-order receive below would deadlock there;
    # shoal sends eagerly and matches by (source, tag).
    if backend == "shoal" and rank == 0:
        dist.send(torch.full((5,), 1.0), dst=1, tag=1)
        dist.send(torch.full((5,), 2.0), dst=1, tag=2)
    elif backend == "shoal" and rank == 1:
        second, first = torch.zeros(5), torch.zeros(5)
        assert dist.recv(second, src=0, tag=2) == 0  # matched by tag, not by arrival order
        dist.recv(first, src=0, tag=1)
        assert torch.all(first == 1.0) and torch.all(second == 2.0)
    # Every rank sends a big tensor to the next and receives from the previous at the same time.
    out = torch.full((4_000_000,), float(rank))
    back = torch.empty(4_000_000)
    works = [dist.isend(out, dst=(rank + 1) % world), dist.irecv(back, src=(rank - 1) % world)]
    for work in works:
        work.wait()
    assert torch.all(back == float((rank - 1) % world))


@pytest.mark.parametrize("backend", ["shoal", "gloo"])
def test_point_to_point_by_tag_and_crossing_transfers(backend: str) -> None:
    run_ranks(_point_to_point, 3, backend, backend=backend)


def _p2p_mismatch(rank: int, world: int) -> str:
    if rank == 0:
        dist.send(torch.ones(4, dtype=torch.float64), dst=1)
        return "sent"
    with pytest.raises(shoal.CollectiveMismatchError, match="rank 0") as info:
        dist.recv(torch.ones(4, dtype=torch.float32), src=0)
    return str(info.value)


def test_point_to_point_dtype_mismatch_names_the_sender() -> None:
    out = run_ranks(_p2p_mismatch, 2)
    assert "float64" in out[1] and "float32" in out[1]


def _subgroups(rank: int, world: int) -> None:
    evens = dist.new_group([0, 2])
    tail = dist.new_group([1, 2])
    outside = dist.GroupMember.NON_GROUP_MEMBER  # what new_group gives a rank it leaves out, as in torch
    assert (evens == outside) == (rank == 1) and (tail == outside) == (rank == 0)
    if evens != outside:
        t = torch.full((10,), float(rank))
        dist.all_reduce(t, group=evens)
        assert torch.all(t == 2.0) and dist.get_world_size(evens) == 2
    if tail != outside:
        t = torch.full((100_000,), float(rank))
        dist.broadcast(t, src=2, group=tail)  # src is a global rank, as in torch
        assert torch.all(t == 2.0) and dist.get_rank(tail) == rank - 1
        with pytest.raises(ValueError, match="not a member"):
            dist.broadcast(t, src=0, group=tail)
        # Where group and global ranks differ: every rooted and point-to-point op names the global rank.
        mine = torch.full((3,), float(rank))
        gathered = [torch.empty(3) for _ in range(2)] if rank == 2 else None
        dist.gather(mine, gathered, dst=2, group=tail)
        if rank == 2:
            assert [g[0].item() for g in gathered] == [1.0, 2.0]
        got = torch.empty(3)
        dist.scatter(got, [torch.full((3,), 10.0), torch.full((3,), 20.0)] if rank == 2 else None, src=2, group=tail)
        assert torch.all(got == (10.0 if rank == 1 else 20.0))
        total = mine.clone()
        dist.reduce(total, dst=1, group=tail)
        assert torch.all(total == (3.0 if rank == 1 else mine))
        if rank == 1:
            dist.send(torch.full((3,), 5.0), dst=2, group=tail)
        else:
            dist.recv(got, src=1, group=tail)
            assert torch.all(got == 5.0)
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.all(t == world)


@pytest.mark.parametrize("backend", ["shoal", "gloo"])
def test_subgroups(backend: str) -> None:
    run_ranks(_subgroups, 3, backend=backend)


def test_argument_errors_are_clear() -> None:
    out = run_ranks(_argument_errors, 2)
    assert out[0] == out[1] == "ok"


def _argument_errors(rank: int, world: int) -> str:
    with pytest.raises(ValueError, match="one tensor per rank"):
        dist.all_gather([torch.zeros(2)], torch.zeros(2))
    with pytest.raises(ValueError, match="must match"):
        dist.all_gather([torch.zeros(2), torch.zeros(3)], torch.zeros(2))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        dist.all_reduce([1, 2, 3])
    with pytest.raises(ValueError, match="src=5 is not a member"):
        dist.broadcast(torch.zeros(2), src=5)
    with pytest.raises(ValueError, match="tag"):
        dist.isend(torch.zeros(2), dst=1 - rank, tag=-1)
    with pytest.raises(ValueError, match="this rank itself"):
        dist.isend(torch.zeros(2), dst=rank)
    with pytest.raises(TypeError, match="cannot be sent between ranks"):
        dist.all_reduce(torch.zeros(2, dtype=torch.complex32))
    return "ok"


def _sender_leaves_first(rank: int, world: int) -> float:
    if rank == 0:
        dist.send(torch.full((100_000,), 7.0), dst=1)
        dist.destroy_process_group()
        return 7.0
    with pytest.raises(shoal.PeerFailure, match="left the group"):
        dist.recv(torch.empty(1), src=0, tag=5)  # returns once rank 0 has gone
    late = torch.empty(100_000)
    dist.recv(late, src=0)  # posted after the sender left: what it sent is still delivered
    return late.sum().item() / 100_000


def test_data_sent_before_a_peer_leaves_is_still_received() -> None:
    assert run_ranks(_sender_leaves_first, 2) == {0: 7.0, 1: 7.0}
