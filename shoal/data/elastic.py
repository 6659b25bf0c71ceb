"""ElasticSampler: each rank's batches of an epoch whose membership may change mid-way, with every
sample trained exactly once.

The epoch is one shuffled order of the dataset, the same on every rank, and the job's progress is one
committed offset into it. Each step takes the next `batch_size * world_size` samples after what was
handed out before (rank r the r-th slice); the last step of an epoch takes what is left, split as
evenly as the ranks allow. Once a step is applied on every rank, `commit()` moves the
offset past it; when a step fails, `discard()` hands its samples out again. After a rank is lost, the
survivors call `set_membership` and share the lost rank's uncommitted samples as well as their own; a
rank that joins loads the offset from a live one (`state_dict`).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sized
from typing import Any

import torch


class ElasticSampler(torch.utils.data.Sampler[list[int]]):
    """A batch sampler (`DataLoader(dataset, batch_sampler=sampler)`): yields lists of indices.

    Steps handed out but not yet committed queue up in order (a DataLoader's workers fetch ahead), and
    `commit()` commits the oldest. `discard()` and `set_membership()` end the iteration in progress
    (it may hold batches that will be handed out again): start a new one, `iter(loader)`.
    """

    def __init__(self, dataset: Sized, batch_size: int, *, rank: int, world_size: int, shuffle: bool = True,
                 seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.epoch = 0
        self.offset = 0
        """Where the committed samples of this epoch end, in the epoch's order."""
        self._handed_out = 0  # where the samples handed out end
        self._steps: collections.deque[int] = collections.deque()  # where each uncommitted step ends
        self._iteration = 0  # iterations older than this one end at their next step
        self.set_membership(rank, world_size)

    def set_membership(self, rank: int, world_size: int) -> None:
        """Take part as `rank` of `world_size` from the committed offset on; uncommitted steps are put back."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1} for world_size {world_size}")
        self.rank, self.world_size = rank, world_size
        self.discard()

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` (its own order) from its beginning; every rank must pass the same value."""
        self.epoch, self.offset = epoch, 0
        self.discard()

    def commit(self) -> None:
        """The oldest step handed out is trained on every rank: its samples are never handed out again."""
        if not self._steps:
            raise RuntimeError("ElasticSampler.commit: no step was handed out since the last commit or discard")
        self.offset = self._steps.popleft()

    def discard(self) -> None:
        """Every uncommitted step is to be trained again, by whoever the members then are."""
        self._handed_out = self.offset
        self._steps.clear()
        self._iteration += 1

    def __iter__(self) -> Iterator[list[int]]:
        order, iteration = self.order(), self._iteration
        while self._handed_out < len(order) and iteration == self._iteration:
            start = self._handed_out
            size = self._step_size(len(order) - start)
            share, extra = divmod(size, self.world_size)
            lo = start + self.rank * share + min(self.rank, extra)
            hi = lo + share + (self.rank < extra)
            self._handed_out = start + size
            self._steps.append(self._handed_out)
            yield order[lo:hi]

    @property
    def uncommitted(self) -> int:
        """Steps handed out and not yet committed."""
        return len(self._steps)

    @property
    def handed_out_all(self) -> bool:
        """Whether the epoch's last step has been handed out."""
        return self._handed_out >= len(self.dataset)

    def __len__(self) -> int:
        """Steps left in this epoch after what was handed out, with the current membership."""
        full, rest = divmod(len(self.dataset) - self._handed_out, self.batch_size * self.world_size)
        return full + (rest > 0 and not (full and rest < self.world_size))

    def _step_size(self, left: int) -> int:
        """How many samples the next step takes when `left` remain: a full step, or all of them when a
        full step would leave fewer than one per rank (a batch of none would fail to collate)."""
        step = self.batch_size * self.world_size
        return left if left - step < self.world_size else step

    def order(self) -> list[int]:
        """The epoch's samples in the order steps take them: those of the steps committed so far are
        `order()[:offset]`."""
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=generator).tolist()

    def state_dict(self) -> dict[str, Any]:
        """What a joining rank needs to go on from the committed offset (membership is its own)."""
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.offset = state["epoch"], state["offset"]
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.discard()
