"""Join: training on uneven inputs, torch.distributed.algorithms.join's protocol and names. A rank that
runs out of inputs "joins": it shadows the collectives the other ranks still make, so that they do not hang.

    with Join([ddp, optimizer]):            # or, for DistributedDataParallel alone: with ddp.join():
        for x, y in batches:                # as many as this rank has
            loss_fn(ddp(x), y).backward()
            optimizer.step()

Each iteration the first Joinable of a live rank calls `Join.notify_join_context`, which all-reduces a 1.
A rank that has left the loop is in `Join.__exit__`, all-reducing a 0 with it: the sum is the number of
ranks still live. While it is not 0, the joined rank runs every hook's `main_hook` (one live iteration's
collectives, shadowed); when it is, every rank runs `post_hook(is_last_joiner)`.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Any, NamedTuple

import torch

import shoal.distributed as dist
from shoal.distributed import Work

__all__ = ["Join", "JoinHook", "Joinable"]

_WARN_THRESHOLD = 1000  # torch's: shadowed iterations after which a joined rank warns of the skew


class JoinHook:
    """What one Joinable does while joined (`main_hook`, once per iteration the live ranks make) and once
    every rank has joined (`post_hook`). The defaults do nothing; override what applies."""

    def main_hook(self) -> None:
        """Shadow the collectives one training iteration (forward, backward, optimizer step) makes."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Runs once all ranks have joined; `is_last_joiner` is True on the ranks that joined last
        (those that ran no `main_hook`), so that they can be the source of a final synchronization."""


class Joinable(ABC):
    """What takes part in a Join: it gives its hook, and the device and process group of the join's own
    collectives; its constructor must call `Joinable.__init__`, and each iteration, before its own
    collectives, it calls `Join.notify_join_context(self)`."""

    @abstractmethod
    def __init__(self) -> None:
        super().__init__()
        self._join_config = _JoinConfig.construct_disabled_join_config()

    @abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """This Joinable's hook; `kwargs` are those given to Join, the same for every Joinable of it."""

    @property
    @abstractmethod
    def join_device(self) -> torch.device:
        """Where the tensors of the join's collectives live (a GPU for NCCL)."""

    @property
    @abstractmethod
    def join_process_group(self) -> Any:
        """The process group of the join's collectives (the same for every Joinable of one Join)."""


class _JoinConfig(NamedTuple):
    """What a Join tells each of its Joinables: whether it is enabled, whether to raise when a rank joins,
    and whether this Joinable is the first (the one whose notification makes the collectives)."""

    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool

    @staticmethod
    def construct_disabled_join_config() -> _JoinConfig:
        """Outside any Join: notify_join_context does nothing."""
        return _JoinConfig(enable=False, throw_on_early_termination=False, is_first_joinable=False)


class Join:
    """Context manager that lets ranks with fewer inputs shadow the others' collectives until all have joined.

    `joinables`' hooks run in the given order; they must share one process group, and the first one's
    device is used. `enable=False` turns the manager off (for inputs known to be even). With
    `throw_on_early_termination=True` every rank raises RuntimeError as soon as one runs out of inputs,
    instead of training on with fewer. `kwargs` go to every Joinable's `join_hook`.
    """

    def __init__(self, joinables: list[Joinable], enable: bool = True, throw_on_early_termination: bool = False,
                 **kwargs: Any) -> None:
        if len(joinables) == 0:
            raise ValueError("The join context manager requires at least one joinable")
        for index, joinable in enumerate(joinables):
            # Duck typing is allowed, as in torch: what is needed is the hook (and the config Joinable sets).
            if not callable(getattr(joinable, "join_hook", None)):
                raise TypeError(f"joinables[{index}] is a {type(joinable).__name__}, not a Joinable: each needs "
                                f"join_hook(), join_device and join_process_group (see shoal.parallel.Joinable)")
        self._joinables = list(joinables)
        self._join_hooks = [joinable.join_hook(**kwargs) for joinable in self._joinables]
        self._enable = enable
        self._throw_on_early_termination = throw_on_early_termination
        self._set_joinable_configs()
        self._extract_dist_info()

    def _set_joinable_configs(self) -> None:
        """Tell each Joinable this Join's settings; only the first one makes the collectives."""
        for index, joinable in enumerate(self._joinables):
            joinable._join_config = _JoinConfig(enable=self._enable,
                                                throw_on_early_termination=self._throw_on_early_termination,
                                                is_first_joinable=index == 0)

    def _extract_dist_info(self) -> None:
        """The process group all Joinables share, and the first one's device."""
        process_group, device = None, None
        for joinable in self._joinables:
            if process_group is None:
                process_group = joinable.join_process_group
            elif process_group != joinable.join_process_group:
                raise ValueError("Using join context manager with multiple process groups")
            if device is None:
                device = joinable.join_device
        self._process_group = process_group
        self._rank = dist.get_rank(self._process_group)
        self._device = device

    def __enter__(self) -> None:
        """Tell the Joinables this Join's settings again: `__exit__` took them back, and one Join object may
        serve several blocks (`j = Join([model])`, then `with j:` once per epoch)."""
        self._set_joinable_configs()

    def __exit__(self, type: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        """Run the main hooks until every rank has joined, then the post-hooks. An exception from the
        block goes on as it is. Raises RuntimeError, with throw_on_early_termination, if ranks are still live.

        Unlike torch, the Joinables are then told they are outside any Join (a deliberate difference): a
        later forward, such as evaluating on one rank alone, makes no join collectives that nobody matches.
        """
        try:
            if self._enable and type is None:
                self._shadow_until_all_joined()
        finally:
            for joinable in self._joinables:
                joinable._join_config = _JoinConfig.construct_disabled_join_config()

    def _shadow_until_all_joined(self) -> None:
        is_last_joiner = True
        shadowed = 0
        while self._get_num_nonjoined_procs() > 0:
            if shadowed == _WARN_THRESHOLD + 1:  # torch warns at every iteration past it, shown once
                warnings.warn(f"Detected uneven input skew of greater than {_WARN_THRESHOLD}. This means that rank "
                              f"{self._rank} has at least {_WARN_THRESHOLD} fewer inputs than other "
                              f"currently-active ranks. This level of skew could lead to performance degradation "
                              f"during training.", stacklevel=3)
            if self._throw_on_early_termination:
                self._notify_procs_to_terminate()
            for join_hook in self._join_hooks:
                join_hook.main_hook()
            is_last_joiner = False
            shadowed += 1
        for join_hook in self._join_hooks:
            join_hook.post_hook(is_last_joiner)

    def _get_num_nonjoined_procs(self) -> float:
        """How many ranks are still live: a joined rank's 0 meets each live rank's notification."""
        num_nonjoined_procs = torch.zeros(1, device=self._device)
        dist.all_reduce(num_nonjoined_procs, group=self._process_group)
        return num_nonjoined_procs.item()

    def _notify_procs_to_terminate(self) -> None:
        """Meet the live ranks' check with a 1, so that they raise too, and raise here."""
        dist.all_reduce(torch.ones(1, device=self._device), group=self._process_group)
        raise RuntimeError(f"Rank {self._rank} exhausted all inputs.")

    @staticmethod
    def notify_join_context(joinable: Joinable) -> Work | None:
        """Tell the joined ranks that this one has not joined; with throw_on_early_termination, raise
        RuntimeError on every live rank if some rank has. Call it each iteration before the Joinable's own
        collectives. Only the first Joinable of a Join makes collectives: it gets the notification's
        Work (not yet waited for); the others, and any Joinable outside a Join, get None."""
        if not hasattr(joinable, "_join_config"):
            raise AssertionError(f"Check that the {type(joinable)} constructor calls the ``Joinable`` constructor")
        join_config = joinable._join_config
        if not join_config.is_first_joinable or not join_config.enable:
            return None
        device, process_group = joinable.join_device, joinable.join_process_group
        work = dist.all_reduce(torch.ones(1, device=device), group=process_group, async_op=True)
        if join_config.throw_on_early_termination:
            exhausted = torch.zeros(1, device=device)  # a joined rank puts a 1 here (_notify_procs_to_terminate)
            dist.all_reduce(exhausted, group=process_group)
            if exhausted.item():
                raise RuntimeError("Detected at least one rank that exhausted inputs. Throwing across all ranks.")
        return work
