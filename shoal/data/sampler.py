"""DistributedSampler: each rank's share of a dataset's indices, the same ones torch's sampler yields."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch


def _world_default(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is not None and rank is not None:
        return num_replicas, rank
    import shoal.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("DistributedSampler needs num_replicas= and rank=, or an initialized process group")
    return (dist.get_world_size() if num_replicas is None else num_replicas,
            dist.get_rank() if rank is None else rank)


class DistributedSampler(torch.utils.data.Sampler[int]):
    """Splits `dataset`'s indices among `num_replicas` ranks, reshuffled per epoch with `set_epoch`.

    Every rank gets the same number of indices: without `drop_last` the list is padded by repeating
    its head; with it, the tail that does not divide evenly is dropped. The order is exactly
    `torch.utils.data.DistributedSampler`'s, so runs are comparable sample for sample.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        num_replicas, rank = _world_default(num_replicas, rank)
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        n = len(dataset)
        if drop_last and n % num_replicas:
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=generator).tolist()
        else:
            indices = list(range(n))
        if self.drop_last:
            indices = indices[:self.total_size]
        elif self.total_size > n:
            padding = self.total_size - n
            indices += (indices * math.ceil(padding / n))[:padding]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for this epoch; every rank must pass the same value."""
        self.epoch = epoch
