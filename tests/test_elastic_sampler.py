"""ElasticSampler: whatever the sequence of failures and joins, every sample of an epoch is trained
exactly once (the ledger of committed steps), and the committed offset is what a joiner takes."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from shoal.data import ElasticSampler


def _run_epoch(n: int, batch_size: int, world_size: int, seed: int,
               epoch: int = 0) -> tuple[collections.Counter, collections.Counter]:
    """One epoch of a simulated job: each step every member takes its batch; then either a member dies
    mid-step (the step is discarded, the survivors go on), or a new member joins at the step boundary
    (it loads the state of a live one), or the step commits into the ledger. Returns the ledger and
    how many members were lost and joined."""
    rng = random.Random(seed)
    dataset = range(n)
    members = [ElasticSampler(dataset, batch_size, rank=r, world_size=world_size, seed=7) for r in range(world_size)]
    for sampler in members:
        sampler.set_epoch(epoch)
    batches = [iter(s) for s in members]
    ledger: collections.Counter = collections.Counter()
    events: collections.Counter = collections.Counter()
    while True:
        try:
            step = [next(it) for it in batches]
        except StopIteration:
            assert all(next(it, None) is None for it in batches)  # every member saw the end together
            return ledger, events
        event = rng.random()
        if event < 0.15 and len(members) > 1:
            del members[rng.randrange(len(members))]
            events["lost"] += 1
        elif event < 0.25 and len(members) < 5:
            for sampler in members:
                sampler.commit()
            ledger.update(i for batch in step for i in batch)
            joiner = ElasticSampler(dataset, batch_size, rank=0, world_size=1)
            joiner.load_state_dict(members[rng.randrange(len(members))].state_dict())
            members.insert(rng.randrange(len(members) + 1), joiner)
            events["joined"] += 1
        else:
            for sampler in members:
                sampler.commit()
            ledger.update(i for batch in step for i in batch)
            continue
        for rank, sampler in enumerate(members):
            sampler.set_membership(rank, len(members))
        assert len({s.offset for s in members}) == 1
        batches = [iter(s) for s in members]


@pytest.mark.parametrize("seed", range(12))
def test_every_sample_is_trained_exactly_once_through_failures_and_joins(seed: int) -> None:
    n = 997  # not a multiple of any step size
    ledger, events = _run_epoch(n, batch_size=7, world_size=1 + seed % 4, seed=seed, epoch=seed)
    assert events["lost"] and events["joined"]
    missing = [i for i in range(n) if ledger[i] == 0]
    twice = [i for i, count in ledger.items() if count > 1]
    assert (missing, twice) == ([], [])


def test_each_step_takes_the_next_samples_of_the_epochs_order() -> None:
    order = torch.randperm(20, generator=torch.Generator().manual_seed(3 + 1)).tolist()
    samplers = [ElasticSampler(range(20), 3, rank=r, world_size=2, seed=3) for r in range(2)]
    for s in samplers:
        s.set_epoch(1)
    steps = list(zip(*samplers, strict=True))
    assert [b for step in steps for b in step] == [order[0:3], order[3:6], order[6:9], order[9:12], order[12:15],
                                                   order[15:18], order[18:19], order[19:20]]
    assert len(ElasticSampler(range(20), 3, rank=0, world_size=2)) == 4


@pytest.mark.parametrize(("n", "batch_size", "world_size"), [(61, 2, 3), (12, 2, 3), (13, 2, 3), (14, 2, 3),
                                                            (7, 2, 3), (3, 5, 3), (100, 7, 4)])
def test_no_rank_gets_an_empty_batch_and_len_counts_the_steps(n: int, batch_size: int, world_size: int) -> None:
    samplers = [ElasticSampler(range(n), batch_size, rank=r, world_size=world_size) for r in range(world_size)]
    assert len(samplers[0]) == len(steps := list(zip(*samplers, strict=True)))
    assert all(len(batch) > 0 for step in steps for batch in step)
    assert sorted(i for step in steps for batch in step for i in batch) == list(range(n))


def test_steps_fetched_ahead_commit_in_order_and_discard_hands_them_out_again() -> None:
    sampler = ElasticSampler(range(12), 2, rank=0, world_size=2, shuffle=False)
    loader = torch.utils.data.DataLoader(torch.arange(100, 112), batch_sampler=sampler)
    batches = iter(loader)
    assert [next(batches).tolist() for _ in range(3)] == [[100, 101], [104, 105], [108, 109]]
    sampler.commit()
    assert sampler.offset == 4  # only the oldest step: the other two were fetched, not trained
    sampler.discard()
    assert next(batches, None) is None  # the iteration in progress ends
    assert [b.tolist() for b in loader] == [[104, 105], [108, 109]]


def test_a_rank_that_joins_takes_over_from_the_committed_offset() -> None:
    live = ElasticSampler(range(10), 2, rank=0, world_size=1, shuffle=False)
    batches = iter(live)
    next(batches)
    live.commit()
    next(batches)  # handed out, not committed: the joiner must not skip it
    joiner = ElasticSampler(range(10), 2, rank=0, world_size=1)
    joiner.load_state_dict(live.state_dict())
    joiner.set_membership(1, 2)
    live.set_membership(0, 2)
    assert (next(iter(live)), next(iter(joiner))) == ([2, 3], [4, 5])


def test_misuse_is_refused() -> None:
    sampler = ElasticSampler(range(4), 2, rank=0, world_size=1)
    with pytest.raises(RuntimeError, match="no step was handed out"):
        sampler.commit()
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        sampler.set_membership(2, 2)
    with pytest.raises(ValueError, match="batch_size"):
        ElasticSampler(range(4), 0, rank=0, world_size=1)
