"""Samplers and partitioners: the same indices as torch's DistributedSampler; disjoint seeded parts."""

from __future__ import annotations

import pytest
import torch.utils.data as tud

from shoal.data import DataPartitioner, DistributedSampler


@pytest.mark.parametrize("length", [1, 7, 10, 23])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_distributed_sampler_matches_torch(length: int, replicas: int, shuffle: bool, drop_last: bool) -> None:
    data = list(range(length))
    for rank in range(replicas):
        ours = DistributedSampler(data, replicas, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
        theirs = tud.DistributedSampler(data, replicas, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_sampler_shards_cover_the_dataset_once_per_epoch() -> None:
    data = list(range(20))
    shards = [list(DistributedSampler(data, 4, r, seed=1)) for r in range(4)]
    assert sorted(i for shard in shards for i in shard) == data


def test_sampler_rejects_a_bad_rank() -> None:
    with pytest.raises(ValueError, match="rank 4 is outside"):
        DistributedSampler(list(range(5)), 4, 4)


def test_partitioner_parts_are_disjoint_seeded_and_sized() -> None:
    data = list(range(100))
    a = DataPartitioner(data, [0.5, 0.25, 0.25], seed=3)
    b = DataPartitioner(data, [0.5, 0.25, 0.25], seed=3)
    parts = [list(a.use(i)) for i in range(3)]
    assert [len(p) for p in parts] == [50, 25, 25]
    assert sorted(x for p in parts for x in p) == data
    assert parts == [list(b.use(i)) for i in range(3)]
    assert parts != [list(DataPartitioner(data, [0.5, 0.25, 0.25], seed=4).use(i)) for i in range(3)]
    with pytest.raises(ValueError, match="sizes"):
        DataPartitioner(data, [0.7, 0.7])
