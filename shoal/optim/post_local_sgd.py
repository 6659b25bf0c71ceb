"""`PostLocalSGDOptimizer`: post-local SGD (https://arxiv.org/abs/1808.07217) as an optimizer. Each step runs
the local optimizer, then hands the parameters to a model averager, which averages them over the ranks
periodically once its warm-up is over (torch.distributed.optim.PostLocalSGDOptimizer's interface).

    opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                PeriodicModelAverager(period=4, warmup_steps=100))
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from shoal.parallel.model_averaging import ModelAverager


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """Wraps `optim`: its param groups and state are this optimizer's, and `state_dict()` adds the averager's
    step under "step", so that a resumed job neither warms up again nor averages at other steps.

    A torch.optim.Optimizer for isinstance checks (learning-rate schedulers), but, as torch's, it never runs
    Optimizer's constructor: everything is the wrapped optimizer's."""

    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager) -> None:
        self.optim = optim
        self.averager = averager

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's, always: torch's copies the list once, and after `load_state_dict` (which
        gives the wrapped optimizer new group dicts) a scheduler stepping it would change stale ones."""
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optim.param_groups = groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    def __repr__(self) -> str:
        return repr(self.optim)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, plus "step": the averager's step count."""
        state = self.optim.state_dict()
        state["step"] = self.averager.step
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state and the averager's step; a state dict without "step" (a plain
        optimizer's) warns and restarts the averager's count from 0, as torch's does."""
        self.optim.load_state_dict(state_dict)
        if "step" in state_dict:
            self.averager.step = state_dict["step"]
        else:
            warnings.warn("the state dict holds no step count for the model averager (no 'step' key): the "
                          "averager starts again from step 0, warm-up included", stacklevel=2)
            self.averager.step = 0

    def step(self) -> None:  # type: ignore[override]
        """One local step, then the averager's turn (an all-reduce on averaging steps: every rank calls it)."""
        self.optim.step()
        self.averager.average_parameters(params=self.param_groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)
