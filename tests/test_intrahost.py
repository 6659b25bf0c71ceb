"""Collectives through shared memory between ranks on one host: results over several rounds, the
choice of path when some ranks cannot share memory or are named onto other hosts (the hierarchical
all-reduce), agreement with the ring, mismatched calls that do not hang, and nothing left behind."""

from __future__ import annotations

import os
import queue
import threading
import time
from datetime import timedelta

import pytest
import torch

import shoal
import shoal.distributed as dist
from shoal.comm.algorithms import hierarchy, ring
from shoal.comm.backends import native
from shoal.comm.shm import arena, futex
from shoal.comm.shm.region import Region
from tests.ranks import run_ranks

pytestmark = pytest.mark.skipif(not futex.supported(), reason="shared-memory collectives need Linux on x86-64")

OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
# Float32 elements in two and a half rounds of a member's inputs: every path crosses round boundaries.
ROUNDS_NUMEL = arena.INPUT_BYTES // 4 * 5 // 2 + 3


def _data(rank: int, numel: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Small positive integers, so that every order of reduction gives the same, exact result."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randint(1, 3, (numel,), generator=gen).to(dtype)


def _reference(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack(tensors)
    if op == "SUM":
        return stacked.sum(0)
    if op == "AVG":
        return stacked.sum(0) / len(tensors)
    if op == "PRODUCT":
        return stacked.prod(0)
    return stacked.amin(0) if op == "MIN" else stacked.amax(0)


def _assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert torch.equal(got, want), f"{what}: {int((got != want).sum())} elements differ, first {got[got != want][:5]}"


def _every_collective(rank: int, world: int, numel: int) -> tuple[tuple[int, ...], ...]:
    for seed, op in enumerate(OPS):
        inputs = [_data(r, numel, seed=seed) for r in range(world)]
        tensor = inputs[rank].clone()
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
        _assert_equal(tensor, _reference(inputs, op), f"all_reduce {op}")
    for root in range(world):
        tensor = _data(rank, numel, seed=10 + root)
        dist.broadcast(tensor, src=root)
        _assert_equal(tensor, _data(root, numel, seed=10 + root), f"broadcast from {root}")
    outs = [torch.empty(numel) for _ in range(world)]
    dist.all_gather(outs, _data(rank, numel, seed=20))
    for r in range(world):
        _assert_equal(outs[r], _data(r, numel, seed=20), f"all_gather block {r}")
    for seed, op in enumerate(("SUM", "AVG", "MAX"), start=30):
        out = torch.empty(numel)
        dist.reduce_scatter(out, [_data(rank, numel, seed=seed + 7 * j) for j in range(world)],
                            op=getattr(dist.ReduceOp, op))
        _assert_equal(out, _reference([_data(r, numel, seed=seed + 7 * rank) for r in range(world)], op),
                      f"reduce_scatter {op}")
    dist.barrier()
    return dist.default_group().hosts


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_over_several_rounds_equals_the_reference(world: int) -> None:
    hosts = run_ranks(_every_collective, world, ROUNDS_NUMEL, timeout=120)
    assert all(h == (tuple(range(world)),) for h in hosts.values()), hosts


def _apart(rank: int, world: int, port: int, apart: int, numel: int) -> tuple[tuple[int, ...], ...]:
    if rank == apart:
        os.environ["SHOAL_SHM"] = "0"  # this rank offers no shared memory, as if on a host of its own
    dist.init_process_group("shoal", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    _every_collective(rank, world, 1031)
    return _every_collective(rank, world, numel)


@pytest.mark.parametrize(("world", "apart"), [(3, 2), (4, 0)])
def test_a_group_spanning_hosts_reduces_in_shared_memory_within_them_and_over_the_ring_between(
        world: int, apart: int) -> None:
    hosts = run_ranks(_apart, world, apart, ROUNDS_NUMEL, backend=None, timeout=180)
    together = tuple(r for r in range(world) if r != apart)
    assert all(h == tuple(sorted([together, (apart,)])) for h in hosts.values()), hosts


def _on_named_hosts(rank: int, world: int, port: int, hosts: int, numel: int) -> tuple:
    os.environ["SHOAL_HOST_ID"] = f"host{rank % hosts}"  # with two hosts: ranks 0 and 2 on one, 1 and 3 on the other
    hierarchy.PIECE_BYTES = 256 << 10  # tens of pieces, two at a time on the network
    dist.init_process_group("shoal", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    # One piece: a direct exchange between hosts; an all-reduce's shares either side of the direct exchange's
    # limit (an element apart); the ring.
    for small in (1031, 20_000, 2 * (ring.SMALL_BYTES // 4) + 1, 40_000):
        _every_collective(rank, world, small)
    found = _every_collective(rank, world, numel)
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    dist.all_reduce(tensor)
    return found, tensor


@pytest.mark.parametrize("hosts", [2, 3])
def test_ranks_named_onto_several_hosts_reduce_within_each_and_between_them(hosts: int) -> None:
    world = 2 * hosts
    out = run_ranks(_on_named_hosts, world, hosts, ROUNDS_NUMEL, backend=None, timeout=300)
    assert all(found == tuple((h, h + hosts) for h in range(hosts)) for found, _ in out.values()), out
    want = sum(torch.randn(ROUNDS_NUMEL, generator=torch.Generator().manual_seed(r)).double() for r in range(world))
    torch.testing.assert_close(out[0][1].double(), want, rtol=0, atol=1e-5)
    assert all(torch.equal(tensor, out[0][1]) for _, tensor in out.values())  # one result, gathered on every rank


def _shares_across_a_round(rank: int, world: int, port: int) -> None:
    os.environ["SHOAL_HOST_ID"] = f"host{rank % 2}"
    hierarchy.PIECE_BYTES = 1 << 30  # one piece, cut into a share per place
    dist.init_process_group("shoal", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    numel = 2 * (arena.INPUT_BYTES // 4) + 1  # the first share is an element longer: a round more in the arena
    inputs = [_data(r, numel) for r in range(world)]
    tensor = inputs[rank].clone()
    dist.all_reduce(tensor)
    _assert_equal(tensor, _reference(inputs, "SUM"), "all_reduce")
    dist.destroy_process_group()


def test_a_hierarchical_all_reduce_whose_shares_take_different_rounds_in_the_arena() -> None:
    run_ranks(_shares_across_a_round, 4, backend=None, timeout=120)


def _send_late(delay_s: float) -> None:
    """Hand every frame of this process to the transport `delay_s` after the algorithm sends it, in
    order, as a deep queue in front of a slow link would: an algorithm may count on a send being out
    only once its channel is flushed. The channel's flush still waits for the late frames."""
    due: queue.SimpleQueue = queue.SimpleQueue()
    on_time = native._OpChannel.send

    def send(self: native._OpChannel, dst: int, sub: int, view: memoryview) -> None:
        self._tracker.add()
        due.put((time.monotonic() + delay_s, self, dst, sub, view))

    def sender() -> None:
        while True:
            at, ch, dst, sub, view = due.get()
            time.sleep(max(0.0, at - time.monotonic()))
            try:
                on_time(ch, dst, sub, view)
                ch._tracker.settle(None)
            except BaseException as exc:  # the operation failed meanwhile: its flush raises this
                ch._tracker.settle(exc)

    native._OpChannel.send = send
    threading.Thread(target=sender, daemon=True, name="late-sends").start()


def _late_on_three_hosts(rank: int, world: int, port: int, numel: int) -> None:
    os.environ["SHOAL_HOST_ID"] = f"host{rank % 3}"
    hierarchy.PIECE_BYTES = 256 << 10
    _send_late(0.02)
    dist.init_process_group("shoal", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    for seed, op in enumerate(("SUM", "MAX")):
        inputs = [_data(r, numel, seed=seed) for r in range(world)]
        tensor = inputs[rank].clone()
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
        _assert_equal(tensor, _reference(inputs, op), f"all_reduce {op}")
        out = torch.empty(numel)
        dist.reduce_scatter(out, [_data(rank, numel, seed=seed + 7 * j) for j in range(world)],
                            op=getattr(dist.ReduceOp, op))
        _assert_equal(out, _reference([_data(r, numel, seed=seed + 7 * rank) for r in range(world)], op),
                      f"reduce_scatter {op}")
    outs = [torch.empty(numel) for _ in range(world)]
    dist.all_gather(outs, _data(rank, numel, seed=20))
    for r in range(world):
        _assert_equal(outs[r], _data(r, numel, seed=20), f"all_gather block {r}")
    dist.destroy_process_group()


def test_hierarchical_collectives_over_three_hosts_are_right_when_sends_go_out_late() -> None:
    """With two pieces on the network, a piece's receives reuse the scratch of the piece two before while
    that one's sends may still be queued: they must not read it (the reduce-scatter once did)."""
    run_ranks(_late_on_three_hosts, 6, ROUNDS_NUMEL, backend=None, timeout=180)


def test_a_waiting_member_polls_only_where_every_member_has_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """Polling a counter takes a core: with more members than cores it would delay the member awaited."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert arena.poll_seconds(2) > 0
    assert arena.poll_seconds(3) == 0


def test_a_region_of_another_named_host_is_not_mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_HOST_ID", "here")
    own = Region.create(4096, "test")
    try:
        assert Region.open(own.name, 4096).name == own.name
        monkeypatch.setenv("SHOAL_HOST_ID", "elsewhere")
        with pytest.raises(ValueError, match="on host here, not ours"):
            Region.open(own.name, 4096)
    finally:
        own.close_descriptor()


def _mismatch_on_one_host(rank: int, world: int, port: int) -> str:
    if rank == 2:
        os.environ["SHOAL_SHM"] = "0"
    dist.init_process_group("shoal", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    dist.all_reduce(torch.ones(4))
    try:
        dist.all_reduce(torch.ones(1000 + (rank == 1)))  # rank 2 agrees with rank 0; rank 1 does not
        return "no error"
    except shoal.CollectiveMismatchError as exc:
        return str(exc)


def test_ranks_of_one_host_that_disagree_tell_the_other_hosts() -> None:
    # Rank 2 waits for rank 0 on the ring between hosts: only the mismatch, carried over the transport,
    # ends its wait before the group timeout (120 s, beyond the test's).
    out = run_ranks(_mismatch_on_one_host, 3, backend=None, timeout=60)
    assert all("numel=1001" in text or "numel=1000" in text for text in out.values()), out


def _random_sums(rank: int, world: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    results = []
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        tensor = torch.randn(ROUNDS_NUMEL, generator=gen)
        dist.all_reduce(tensor, op=op)
        results.append(tensor)
    return results


def test_shared_memory_and_the_ring_agree_bitwise_at_world_size_two() -> None:
    # Two addends: every path computes a + b in one rounding, so any difference would be a bug.
    shared = run_ranks(_random_sums, 2)
    ring = run_ranks(_random_sums, 2, env={"SHOAL_SHM": "0"})
    for rank in range(2):
        for got, want in zip(shared[rank], ring[rank], strict=True):
            _assert_equal(got, want, f"rank {rank}")


def _arena_against_ring(rank: int, world: int) -> tuple[str, str]:
    dist.all_reduce(torch.ones(4))  # the arena is set up
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(1000))  # in the arena, waiting for rank 1
        else:
            dist.scatter(torch.empty(1000), None, src=0)  # over the transport, waiting for rank 0
        first = "no error"
    except shoal.CollectiveMismatchError as exc:
        first = str(exc)
    try:
        dist.all_reduce(torch.ones(4))
        second = "no error"
    except shoal.GroupBrokenError as exc:
        second = type(exc).__name__
    return first, second


def test_a_rank_in_the_arena_and_a_rank_on_the_ring_are_both_told_of_the_mismatch() -> None:
    # The group timeout (120 s) is beyond the test's: only the mismatch can end these calls in time.
    out = run_ranks(_arena_against_ring, 2, timeout=60, group_timeout=120)
    assert "scatter" in out[0][0] and "all_reduce" in out[0][0], out
    assert "scatter" in out[1][0] or "all_reduce" in out[1][0], out
    # The arena is out of step now (rank 1 never posted): later collectives in it refuse, on both ranks.
    assert out[0][1] == out[1][1] == "GroupBrokenError", out


def _mismatched_in_the_arena(rank: int, world: int) -> list[str]:
    dist.all_reduce(torch.ones(4))  # the arena is set up: what follows is all in it
    errors = []
    for tensor in (torch.ones(10 + (rank == 1)), torch.ones(300_000 + (rank == 1)),
                   torch.ones(10, dtype=torch.float64 if rank == 0 else torch.float32)):
        try:
            dist.all_reduce(tensor)
            errors.append("no error")
        except shoal.CollectiveMismatchError as exc:
            errors.append(str(exc))
    tensor = torch.full((300_000,), float(rank))
    dist.all_reduce(tensor)  # every rank stopped in the same round: the arena is still in step
    assert torch.equal(tensor, torch.full((300_000,), float(sum(range(world)))))
    dist.barrier()
    return errors


def test_ranks_that_disagree_in_the_arena_are_all_told_and_the_group_goes_on() -> None:
    out = run_ranks(_mismatched_in_the_arena, 3, timeout=60, group_timeout=120)
    for rank, errors in out.items():
        assert "no error" not in errors, (rank, errors)
        assert all("numel=" in e for e in errors[:2]) and "float64" in errors[2], (rank, errors)


def _gather_against_all_reduce(rank: int, world: int) -> str:
    dist.all_reduce(torch.ones(4))
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(1000))  # waits in the arena for rank 1, which has moved on
        else:
            dist.gather(torch.ones(10), [torch.empty(10) for _ in range(world)] if rank == 2 else None, dst=2)
        return "no error"
    except shoal.CollectiveMismatchError as exc:
        return str(exc)


def test_a_rank_in_the_arena_looks_at_every_member_not_only_the_one_it_waits_for() -> None:
    # Rank 1 sends its part of the gather and leaves; rank 0 must see rank 2 in the gather to end.
    out = run_ranks(_gather_against_all_reduce, 3, timeout=60, group_timeout=120)
    assert "gather" in out[0] and "all_reduce" in out[0], out
    assert out[2] != "no error", out


def _arenas_mapped() -> int:
    with open("/proc/self/maps") as f:
        return f.read().count("memfd:shoal-arena")


def _collect_and_leave(rank: int, world: int) -> int:
    dist.all_reduce(torch.ones(ROUNDS_NUMEL))
    return _arenas_mapped()


def test_nothing_is_left_in_dev_shm_and_every_rank_maps_every_arena() -> None:
    before = set(os.listdir("/dev/shm"))
    mapped = run_ranks(_collect_and_leave, 3)
    assert mapped == {0: 3, 1: 3, 2: 3}  # its own region and each peer's
    assert set(os.listdir("/dev/shm")) <= before
