"""Generations of membership: after a worker is killed or stops answering, the others (the same
processes) agree on the next generation through the store that outlives them, build its group, and
go on; a member that the others judged lost is told it is out."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist

from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.store import Store
from shoal.elastic import membership as membership_module
from shoal.elastic.membership import EvictedError, Generation, JobFinished, Membership
from shoal.errors import GroupBrokenError, PeerFailure
from tests.ranks import run_ranks
from tests.waiting import wait_until

STEPS = 8
LOST_AT = 4


def _membership(rank: int, store_port: int) -> Membership:
    store = Store.connect("127.0.0.1", store_port, world_size=1, is_server=False, timeout=timedelta(seconds=30))
    return Membership(store.scoped("live/"), f"worker{rank}", host="127.0.0.1", timeout=timedelta(seconds=30))


def _train_through_a_loss(rank: int, world: int, _: int, store_port: int, victim: int, how: int) -> tuple:
    """All-reduce rank + 1 for STEPS steps; the victim kills or stops itself at step LOST_AT. A survivor
    may see the step before fail too (the loss is noticed while it still waits for another survivor),
    so the survivors go on from the last step that all of them finished."""
    membership = _membership(rank, store_port)
    generation = membership.first(rank, world)
    group = membership.group(generation)
    pids = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    group.all_gather(pids, torch.tensor([os.getpid()])).wait()
    sums, step = [], 0
    while step < STEPS:
        if step == LOST_AT and rank == victim:
            os.kill(os.getpid(), how)
        t = torch.full((1000,), float(rank + 1))
        try:
            group.all_reduce(t).wait()
        except (PeerFailure, GroupBrokenError):
            generation = membership.next(generation, group)
            if how == signal.SIGSTOP and generation.rank(membership.me) == 0:
                os.kill(int(pids[victim].item()), signal.SIGKILL)  # so that the test leaves no stopped process
            group = membership.group(generation)
            finished = torch.tensor([step])
            group.all_reduce(finished, ReduceOp.MIN).wait()
            step = int(finished.item())
            del sums[step:]
            continue
        sums.append((generation.number, t[0].item()))
        step += 1
    group.shutdown()
    return generation, sums


@pytest.mark.parametrize(("victim", "how"), [(1, signal.SIGKILL), (0, signal.SIGKILL), (2, signal.SIGSTOP)],
                         ids=["rank 1 killed", "rank 0 killed", "rank 2 stopped"])
def test_the_others_agree_on_a_generation_without_the_lost_worker_and_go_on(victim: int, how: int) -> None:
    store = Store.connect("127.0.0.1", 0, world_size=1, is_server=True)  # as the launcher serves it
    port = store.raw.port
    out = run_ranks(_train_through_a_loss, 3, port, victim, how, backend=None, expect={victim: "dies"}, timeout=90)
    survivors = [r for r in range(3) if r != victim]
    assert set(out) == set(survivors)
    members = tuple(f"worker{r}" for r in survivors)
    assert out[survivors[0]] == out[survivors[1]]
    generation, sums = out[survivors[0]]
    assert generation == Generation(1, members)
    before = sum(1 for g, _ in sums if g == 0)
    assert before in (LOST_AT - 1, LOST_AT)
    assert sums == [(0, 6.0)] * before + [(1, 6.0 - (victim + 1))] * (STEPS - before)


class _Judging:
    """Stands for a generation's group that has found the given ranks lost."""

    def __init__(self, lost: set[int]) -> None:
        self._lost = frozenset(lost)

    def failed_ranks(self) -> frozenset[int]:
        return self._lost

    def shutdown(self) -> None:
        pass


def test_two_sides_of_a_partition_cannot_both_make_the_next_generation() -> None:
    server = Store(tdist.HashStore())
    first = Generation(0, ("worker0", "worker1"))
    a, b = (Membership(server, f"worker{r}", host="127.0.0.1", timeout=timedelta(seconds=5)) for r in range(2))
    # Each side sees the other as lost; whoever proposes first makes generation 1, the other is out of it.
    assert a.next(first, _Judging({1})) == Generation(1, ("worker0",))
    with pytest.raises(EvictedError, match="generation 1 was agreed without this worker"):
        b.next(first, _Judging({0}))


def test_a_member_neither_joined_nor_lost_is_waited_for_within_the_timeout() -> None:
    alone = Membership(Store(tdist.HashStore()), "worker0", host="127.0.0.1", timeout=timedelta(seconds=0.3))
    with pytest.raises(TimeoutError, match=r"members \['worker1'\] neither joined it nor were found lost"):
        alone.next(Generation(0, ("worker0", "worker1")), _Judging(set()))


def test_a_worker_started_in_place_of_a_lost_one_joins_the_next_generation_after_the_members() -> None:
    store = Store(tdist.HashStore())
    member, joiner = (Membership(store, name, host="127.0.0.1", timeout=timedelta(seconds=10))
                      for name in ("worker0", "worker0-again"))
    first = member.first(0, 1)
    assert first == Generation(0, ("worker0",))
    assert joiner.first(0, 1) is None  # rank 0's place in generation 0 is taken
    assert not member.joiners_waiting(first)
    with ThreadPoolExecutor(1) as pool:
        admitted = pool.submit(joiner.join)
        wait_until(lambda: member.joiners_waiting(first), "the joiner waits to be admitted", timeout=10,
                   interval=0.001)
        second = member.next(first, _Judging(set()))
        assert second == Generation(1, ("worker0", "worker0-again"), joined=1)
        assert admitted.result(timeout=10) == second
    assert not member.joiners_waiting(second)


def test_a_worker_waiting_to_join_a_job_that_finished_ends_with_status_0() -> None:
    store = Store(tdist.HashStore())
    Membership(store, "worker0", host="127.0.0.1", timeout=timedelta(seconds=10)).finish(Generation(0, ("worker0",)))
    late = Membership(store, "late", host="127.0.0.1", timeout=timedelta(seconds=10))
    with pytest.raises(JobFinished) as finished:
        late.join()
    assert finished.value.code == 0


def test_a_joiner_that_gives_up_waiting_withdraws_and_is_not_admitted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(membership_module, "JOIN_WAIT", timedelta(0))
    store = Store(tdist.HashStore())
    member = Membership(store, "worker0", host="127.0.0.1", timeout=timedelta(seconds=10))
    first = member.first(0, 1)
    impatient = Membership(store, "impatient", host="127.0.0.1", timeout=timedelta(seconds=0.2))
    with pytest.raises(TimeoutError, match="its request is withdrawn"):
        impatient.join()
    assert member.joiners_waiting(first)  # its slot stays taken, so the members still look at it
    assert member.next(first, _Judging(set())) == Generation(1, ("worker0",), joined=1)


def test_a_joiner_killed_while_it_waits_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(membership_module, "_JOINER_SILENT_S", 0.5)
    store = Store(tdist.HashStore())
    member = Membership(store, "worker0", host="127.0.0.1", timeout=timedelta(seconds=10))
    first = member.first(0, 1)
    store.compare_set("joins/1", "killed")  # it took a join slot, beat once, and was killed
    store.add("joins/1/beats", 1)
    assert member.joiners_waiting(first)
    assert member.next(first, _Judging(set())) == Generation(1, ("worker0",), joined=1)
    assert store.get("joins/1/generation") == membership_module._PASSED_OVER


def test_a_joiner_passed_over_while_it_still_waits_asks_again_and_is_admitted() -> None:
    store = Store(tdist.HashStore())
    member, joiner = (Membership(store, name, host="127.0.0.1", timeout=timedelta(seconds=10))
                      for name in ("worker0", "slow"))
    first = member.first(0, 1)
    with ThreadPoolExecutor(1) as pool:
        admitted = pool.submit(joiner.join)
        wait_until(lambda: store.has("joins/1"), "the joiner asks to join", timeout=10, interval=0.001)
        store.compare_set("joins/1/generation", membership_module._PASSED_OVER)  # the members thought it silent
        wait_until(lambda: store.has("joins/2"), "the joiner asks again", timeout=10, interval=0.001)
        second = member.next(first, _Judging(set()))
        assert second == Generation(1, ("worker0", "slow"), joined=2)
        assert admitted.result(timeout=10) == second


def _lose_the_last_rank(rank: int, world: int) -> frozenset[int]:
    """The last rank exits once every rank has met; the others wait until their group finds it lost."""
    import shoal.distributed as dist

    group = dist.default_group()
    survivors = dist.new_group(list(range(world - 1)))
    dist.barrier()
    if rank == world - 1:
        os._exit(0)
    # The loss is noticed by the transport's reader thread: poll its verdict.
    found = wait_until(group.failed_ranks, f"rank {rank}'s group finds a rank lost", timeout=30)
    # A survivor that left now would be lost too, to one still looking: neither leaves before both have looked.
    dist.barrier(group=survivors)
    return found


def test_a_shoal_group_names_the_ranks_it_has_lost() -> None:
    found = run_ranks(_lose_the_last_rank, 3, expect={2: "dies"})
    assert found == {0: frozenset({2}), 1: frozenset({2})}


def test_a_membership_refuses_an_unknown_backend() -> None:
    with pytest.raises(ValueError, match=r"unknown backend 'mpi'; choose one of \['gloo', 'nccl', 'shoal'\]"):
        Membership(Store(tdist.HashStore()), "worker0", host="127.0.0.1", timeout=timedelta(seconds=1), backend="mpi")
