"""Model averaging: replicas that train on their own for a while, then average their parameters (local SGD).
torch.distributed.algorithms.model_averaging's averagers and helpers, over shoal's process groups.

    averager = PeriodicModelAverager(period=4, warmup_steps=100)
    for x, y in batches:
        optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
        averager.average_parameters(model.parameters())    # every 4th step after the first 100

`shoal.optim.PostLocalSGDOptimizer` calls the averager after each step for you.
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from shoal.comm.api.world import default_group, is_initialized, is_non_member
from shoal.comm.backends.group import ProcessGroup
from shoal.parallel.comm_hooks import _divide_then_sum

Params = Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]


class UnsupportedParamsError(TypeError, NotImplementedError):
    """An entry of `params` that is neither a tensor nor a param-group dict. Also a NotImplementedError,
    which is what torch raises here, so code written against torch catches it unchanged."""


def average_parameters(params: Iterable[torch.Tensor], process_group: ProcessGroup | None) -> None:
    """Replace each parameter by its mean over `process_group` (None: the default group) with one all-reduce
    of all of them flattened into one buffer (extra memory the size of the parameters, one collective).

    Values are written into each parameter's own storage (torch rebinds `p.data` to a slice of the buffer
    instead): views of a parameter, such as a model in shared memory, stay views of it."""
    group = process_group if process_group is not None else default_group()
    if is_non_member(group):
        return  # a rank outside the group leaves its parameters alone, as torch's does
    params = list(params)
    if not params:
        raise ValueError("average_parameters: no parameters to average (from parameters or param groups, "
                         "only those with a gradient are averaged: call it after backward)")
    # Mixed dtypes are promoted in the buffer and cast back on the way out, as torch's does.
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    _divide_then_sum(flat, group, synchronize_device=True).wait()
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def get_params_to_average(params: Params) -> list[torch.Tensor]:
    """The parameters (of a model, or of an optimizer's param groups) that have a gradient: one without
    was not trained this step on this rank, and torch leaves it out too."""
    kept = []
    for entry in params:
        if isinstance(entry, torch.Tensor):
            candidates = [entry]
        elif isinstance(entry, dict):
            candidates = entry["params"]
        else:
            raise UnsupportedParamsError(f"params must hold parameters or param-group dicts (an optimizer's "
                                         f"param_groups), got an entry of type {type(entry).__name__}")
        kept.extend(p for p in candidates if p.grad is not None)
    return kept


def average_parameters_or_parameter_groups(params: Params, process_group: ProcessGroup | None) -> None:
    """Average the parameters of a model, or of an optimizer's param groups, that have a gradient."""
    average_parameters(get_params_to_average(params), process_group)


class ModelAverager(abc.ABC):
    """Base of the averagers: the group to average over (None: the default group, taken now; under
    LiveTraining, with no default group, each generation's, which it sets) and `step`, the count of
    `average_parameters` calls, which PostLocalSGDOptimizer checkpoints."""

    def __init__(self, process_group: ProcessGroup | None = None) -> None:
        if process_group is None and is_initialized():
            process_group = default_group()
        self.process_group: ProcessGroup | None = process_group
        self.step = 0

    @abc.abstractmethod
    def average_parameters(self, params: Params) -> None:
        raise NotImplementedError


class PeriodicModelAverager(ModelAverager):
    """Averages every `period` steps once `warmup_steps` have passed: at steps warmup_steps,
    warmup_steps + period, ... (counting from 0), and never before. Each call is one step."""

    def __init__(self, period: int, warmup_steps: int = 0, process_group: ProcessGroup | None = None) -> None:
        super().__init__(process_group)
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative number, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        if period < 1:
            raise ValueError(f"period must be a positive number of steps, got {period}")
        if period == 1:
            warnings.warn("period=1 averages the parameters every step, which costs no less than averaging the "
                          "gradients: use DistributedDataParallel alone instead", stacklevel=2)
        self.period = period

    def average_parameters(self, params: Params) -> None:
        """Average `params` (parameters, or an optimizer's param groups) if this step is an averaging one."""
        if self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0:
            average_parameters_or_parameter_groups(params, self.process_group)
        self.step += 1
