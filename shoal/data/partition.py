"""DataPartitioner: a seeded random split of a dataset by fractions, one part per rank (the classic
hand-written data-parallel tutorial's helper)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any


class Partition(Sequence):
    """A view of `data` restricted to `indices`."""

    def __init__(self, data: Sequence, indices: list[int]) -> None:
        self.data, self.indices = data, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        return self.data[self.indices[i]]


class DataPartitioner:
    """Shuffles `data`'s indices with `seed` and cuts them into parts of the given fractions.

    Every rank builds the same partitioner (same seed) and takes `use(rank)`, so the parts are
    disjoint across ranks without any communication.
    """

    def __init__(self, data: Sequence, sizes: Sequence[float] = (0.7, 0.2, 0.1), seed: int = 1234) -> None:
        if not sizes or any(f < 0 for f in sizes) or sum(sizes) > 1 + 1e-9:
            raise ValueError(f"sizes must be non-negative fractions summing to at most 1, got {list(sizes)}")
        self.data = data
        indices = list(range(len(data)))
        random.Random(seed).shuffle(indices)
        self.partitions: list[list[int]] = []
        start = 0
        for fraction in sizes:
            count = int(fraction * len(data))
            self.partitions.append(indices[start:start + count])
            start += count

    def use(self, part: int) -> Partition:
        if not 0 <= part < len(self.partitions):
            raise ValueError(f"part {part} does not exist; there are {len(self.partitions)}")
        return Partition(self.data, self.partitions[part])
