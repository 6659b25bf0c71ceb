"""`DiLoCoOptimizer`: DiLoCo (Douillard et al., https://arxiv.org/abs/2311.08105). Each replica takes
`sync_every` steps of its inner optimizer on its own; then the replicas average how far they moved since the
last synchronization (the pseudo-gradient: where they started minus where they are), and an outer optimizer
steps the parameters they started from with that average as the gradient. One all-reduce every
`sync_every` steps instead of one per step; the paper's outer optimizer is SGD with Nesterov momentum.

    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    opt = DiLoCoOptimizer(inner, outer, sync_every=50)
    for x, y in loader:              # the model is not wrapped in DistributedDataParallel
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.comm.api.world import default_group, is_initialized, is_non_member
from shoal.comm.backends.group import ProcessGroup
from shoal.parallel.comm_hooks import _divide_then_sum


class DiLoCoOptimizer(torch.optim.Optimizer):
    """Wraps the inner optimizer: its param groups and state are this optimizer's (a learning-rate scheduler
    steps the inner one). The outer optimizer must hold the same parameters. At construction every replica
    takes the group's rank 0's parameters (a collective: every rank constructs it), so that all start, and
    after each synchronization stay, equal. Without a group and with no default group yet (under LiveTraining,
    which gives it each generation's group and takes over the synchronizations), it broadcasts nothing.

    Like PostLocalSGDOptimizer, a torch.optim.Optimizer for isinstance checks that never runs Optimizer's
    constructor."""

    def __init__(self, inner: torch.optim.Optimizer, outer: torch.optim.Optimizer, sync_every: int,
                 process_group: ProcessGroup | None = None) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be at least 1, got {sync_every}")
        self.params = [p for group in inner.param_groups for p in group["params"]]
        outer_params = [p for group in outer.param_groups for p in group["params"]]
        if {id(p) for p in outer_params} != {id(p) for p in self.params} or len(outer_params) != len(self.params):
            raise ValueError("the outer optimizer must hold the same parameters as the inner one: it steps them "
                             "from where the replicas last synchronized")
        self.inner, self.outer, self.sync_every = inner, outer, sync_every
        if process_group is None and is_initialized():
            process_group = default_group()
        self.process_group: ProcessGroup | None = process_group
        self.local_steps = 0
        """Inner steps taken: a synchronization follows every `sync_every`-th."""
        if process_group is not None and not is_non_member(process_group):
            with torch.no_grad():
                for p in self.params:
                    self.process_group.broadcast(p.detach(), self.process_group.ranks[0]).wait()
        self._start = [p.detach().clone() for p in self.params]  # the parameters at the last synchronization

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.inner.param_groups = groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    def __repr__(self) -> str:
        return f"DiLoCoOptimizer(sync_every={self.sync_every}, inner={self.inner!r}, outer={self.outer!r})"

    def step(self) -> None:  # type: ignore[override]
        """One inner step; after every `sync_every`-th, the outer step (an all-reduce: every rank calls it)."""
        self.inner.step()
        self.local_steps += 1
        if self.local_steps % self.sync_every == 0:
            self.synchronize()

    @torch.no_grad()
    def synchronize(self) -> None:
        """Average the pseudo-gradients over the group, put every parameter back where it was at the last
        synchronization, and step the outer optimizer there with the average as its gradient. The
        parameters' own `.grad` are left as they were."""
        if self.process_group is None:  # a default group made since would not have started the replicas equal
            raise RuntimeError("DiLoCoOptimizer was made before any process group existed and was given none "
                               "since (LiveTraining gives it one): make it after init_process_group, or pass "
                               "process_group")
        if is_non_member(self.process_group):
            return
        moved = torch.cat([(start - p).reshape(-1) for start, p in zip(self._start, self.params, strict=True)])
        _divide_then_sum(moved, self.process_group).wait()
        grads, offset = [p.grad for p in self.params], 0
        for start, p in zip(self._start, self.params, strict=True):
            p.copy_(start)
            p.grad = moved[offset:offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
        self.outer.step()
        for start, p, grad in zip(self._start, self.params, grads, strict=True):
            p.grad = grad
            start.copy_(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Both optimizers' state, the inner steps taken and where the parameters last synchronized: a job
        resumed from it synchronizes when and from where the uninterrupted one would have. (Taken under
        `LiveTraining`, which ends periods itself, the count resumes but the next synchronization follows
        this optimizer's own rule: docs/training.md.)"""
        return {"inner": self.inner.state_dict(), "outer": self.outer.state_dict(), "local_steps": self.local_steps,
                "start": [start.clone() for start in self._start]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict["inner"])
        self.outer.load_state_dict(state_dict["outer"])
        self.local_steps = state_dict["local_steps"]
        for start, saved in zip(self._start, state_dict["start"], strict=True):
            start.copy_(saved)
