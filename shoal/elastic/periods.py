"""`Periods`: what LiveTraining commits at once for an optimizer that synchronizes the replicas every few
steps (DiLoCoOptimizer, PostLocalSGDOptimizer) instead of averaging gradients at every step.

The replicas take a period's steps on their own; at its end they synchronize (DiLoCo's outer step over the
averaged pseudo-gradients, post-local SGD's average of the parameters), and the members decide, as they
do for a DDP step, whether every one of them did. A committed period commits its steps' samples; a
discarded one is undone on every member back to where it began, and the next generation trains its
samples again. A period also ends with the epoch's last step, so that none spans two epochs.
"""

from __future__ import annotations

import torch

from shoal.comm.backends.group import ProcessGroup
from shoal.data.elastic import ElasticSampler
from shoal.optim.diloco import DiLoCoOptimizer
from shoal.optim.post_local_sgd import PostLocalSGDOptimizer
from shoal.parallel.model_averaging import PeriodicModelAverager, average_parameters_or_parameter_groups


class Periods:
    """The periods of one LiveTraining's optimizer: `length` steps each, `taken` of the current one so far."""

    def __init__(self, optimizer: DiLoCoOptimizer | PostLocalSGDOptimizer) -> None:
        self.optimizer = optimizer
        if isinstance(optimizer, DiLoCoOptimizer):
            self.length, self._local = optimizer.sync_every, optimizer.inner
        else:
            averager = optimizer.averager
            if type(averager) is not PeriodicModelAverager:
                raise TypeError(f"under LiveTraining, PostLocalSGDOptimizer's averager must be a "
                                f"PeriodicModelAverager, got {type(averager).__name__}")
            if averager.warmup_steps:
                raise ValueError("under LiveTraining, post-local SGD's warm-up is DDP's: train the warm-up steps "
                                 "in a LiveTraining of their own with the wrapped optimizer, then hand "
                                 "PostLocalSGDOptimizer, its averager with warmup_steps=0, to the next one")
            self.length, self._local = averager.period, optimizer.optim
        self.taken = 0

    @staticmethod
    def of(optimizer: torch.optim.Optimizer) -> Periods | None:
        """The periods of `optimizer`, or None for one whose steps each commit (under DDP or fully_shard)."""
        return Periods(optimizer) if isinstance(optimizer, DiLoCoOptimizer | PostLocalSGDOptimizer) else None

    def adopt(self, group: ProcessGroup) -> None:
        """Synchronize over `group` from now on (a new generation's)."""
        if isinstance(self.optimizer, DiLoCoOptimizer):
            self.optimizer.process_group = group
        else:
            self.optimizer.averager.process_group = group

    def step(self, sampler: ElasticSampler) -> bool:
        """One local step, counted where the optimizer counts its own (in its state dict, so a discarded period
        takes it back); whether it ends the period (its last step, or the epoch's)."""
        self._local.step()
        if isinstance(self.optimizer, DiLoCoOptimizer):
            self.optimizer.local_steps += 1
        else:
            self.optimizer.averager.step += 1
        self.taken += 1
        return self.taken == self.length or (sampler.handed_out_all and sampler.uncommitted == self.taken)

    def synchronize(self) -> None:
        """The period's end on this replica: a collective, which fails (PeerFailure) if a member is lost."""
        if isinstance(self.optimizer, DiLoCoOptimizer):
            self.optimizer.synchronize()
        else:
            average_parameters_or_parameter_groups(self.optimizer.param_groups, self.optimizer.averager.process_group)

    def end(self) -> int:
        """The period is over (committed or undone): the steps it took."""
        taken, self.taken = self.taken, 0
        return taken
