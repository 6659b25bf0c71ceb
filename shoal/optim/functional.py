"""`as_functional_optim(torch.optim.Adam, lr=0.01)`: an optimizer stepped with gradients given to it, not
read from `.grad` (torch.distributed.optim.as_functional_optim). A DDP hook that steps each parameter as
soon as its gradient is averaged, or trainers that share parameters but not `.grad`, use one.

The object has torch's functional optimizers' interface and constructor arguments (which are not always
torch.optim's: Adam's `foreach` defaults to False, Adagrad takes `warmup_lr_multiplier`):

    f = as_functional_optim(torch.optim.SGD, 0.1, momentum=0.9)
    f.param_group["params"].extend(params)   # it starts empty, as torch's does
    f.step([p_grad, None, ...])              # one gradient (or None: not stepped) per parameter
    f.step_param(p, p_grad)                  # one parameter, in the group or not

Each step runs the torch.optim optimizer itself on the parameters that have a gradient (torch's functional
optimizers call the same kernels), so the update is torch.optim's exactly, and `.grad` is neither read nor
written; `state` is its per-parameter state, and changing `defaults` (the learning rate, say) or a switch
(`f.maximize = True`, `f.foreach`, `f.nesterov`, ...) changes later steps, as in torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import optim

# Per optimizer: its functional constructor's arguments after `params` (names, order and defaults as torch's
# functional_*.py), returning (defaults: the numbers, under torch's keys; the switches, kept as attributes).
_Split = tuple[dict[str, float], dict[str, Any]]


def _sgd(lr: float = 1e-2, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
         nesterov: bool = False, maximize: bool = False, foreach: bool = False, fused: bool = False) -> _Split:
    return ({"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay},
            {"nesterov": nesterov, "maximize": maximize, "foreach": foreach, "fused": fused})


def _adam_like(weight_decay_default: float) -> Callable[..., _Split]:
    def split(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
              weight_decay: float = weight_decay_default, amsgrad: bool = False, maximize: bool = False,
              foreach: bool = False, fused: bool = False) -> _Split:
        return ({"lr": lr, "eps": eps, "beta1": betas[0], "beta2": betas[1], "weight_decay": weight_decay},
                {"amsgrad": amsgrad, "maximize": maximize, "foreach": foreach, "fused": fused})
    return split


def _adagrad(lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
             initial_accumulator_value: float = 0.0, warmup_lr_multiplier: float = 1.0,
             warmup_num_iters: float = 0.0, eps: float = 1e-10, coalesce_grad: bool = True, foreach: bool = False,
             fused: bool = False, maximize: bool = False) -> _Split:
    return ({"lr": lr, "lr_decay": lr_decay, "eps": eps, "weight_decay": weight_decay,
             "initial_accumulator_value": initial_accumulator_value, "warmup_lr_multiplier": warmup_lr_multiplier,
             "warmup_num_iters": warmup_num_iters},
            {"coalesce_grad": coalesce_grad, "foreach": foreach, "fused": fused, "maximize": maximize})


def _adamax(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
            weight_decay: float = 0.0, foreach: bool = False, maximize: bool = False) -> _Split:
    return ({"lr": lr, "eps": eps, "beta1": betas[0], "beta2": betas[1], "weight_decay": weight_decay},
            {"foreach": foreach, "maximize": maximize})


def _rmsprop(lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
             momentum: float = 0.0, centered: bool = False, foreach: bool = False, maximize: bool = False) -> _Split:
    return ({"lr": lr, "alpha": alpha, "eps": eps, "weight_decay": weight_decay, "momentum": momentum},
            {"centered": centered, "foreach": foreach, "maximize": maximize})


def _rprop(lr: float = 1e-2, etas: tuple[float, float] = (0.5, 1.2), step_sizes: tuple[float, float] = (1e-6, 50),
           foreach: bool = False, maximize: bool = False) -> _Split:
    return {"lr": lr}, {"etas": etas, "step_sizes": step_sizes, "foreach": foreach, "maximize": maximize}


def _adadelta(lr: float = 1.0, rho: float = 0.9, eps: float = 1e-6, weight_decay: float = 0.0,
              foreach: bool = False, maximize: bool = False) -> _Split:
    return ({"lr": lr, "rho": rho, "eps": eps, "weight_decay": weight_decay},
            {"foreach": foreach, "maximize": maximize})


_FUNCTIONAL: dict[type, Callable[..., _Split]] = {
    optim.Adagrad: _adagrad, optim.Adam: _adam_like(0.0), optim.AdamW: _adam_like(1e-2), optim.SGD: _sgd,
    optim.Adadelta: _adadelta, optim.RMSprop: _rmsprop, optim.Rprop: _rprop, optim.Adamax: _adamax,
}
# Arguments torch's functional Adagrad takes and never uses; torch.optim.Adagrad has no such arguments.
_UNUSED = ("warmup_lr_multiplier", "warmup_num_iters", "coalesce_grad")


class FunctionalOptimizer:
    """One param group (`param_group["params"]`, a list the caller may extend) stepped with the gradients
    given; see the module's docstring. Built by `as_functional_optim`."""

    def __init__(self, optim_cls: type[optim.Optimizer], params: Sequence[torch.Tensor], *args: Any,
                 _allow_empty_param_list: bool = False, **kwargs: Any) -> None:
        if optim_cls not in _FUNCTIONAL:
            raise ValueError(f"Optimizer {optim_cls} does not have a functional counterpart! Those that have: "
                             f"{', '.join(sorted(c.__name__ for c in _FUNCTIONAL))}")
        self.defaults, switches = _FUNCTIONAL[optim_cls](*args, **kwargs)
        for name, value in switches.items():
            setattr(self, name, value)  # torch's functional optimizers keep them as attributes
        self._switch_names = tuple(switches)  # read back at every step: `f.maximize = True` counts, as in torch
        if len(params) == 0 and not _allow_empty_param_list:
            raise ValueError("optimizer got an empty parameter list")
        self.param_group: dict[str, list[torch.Tensor]] = {"params": list(params)}
        self.state: dict[torch.Tensor, dict[str, Any]] = {}
        self._cls = optim_cls
        # Built here, over a stand-in parameter, so that bad hyperparameters raise now, with torch.optim's
        # messages; each step points its group at the parameters being stepped.
        self._optim = optim_cls([torch.zeros(1)], **self._optim_kwargs())
        self._lock = threading.Lock()

    def _optim_kwargs(self) -> dict[str, Any]:
        """torch.optim's arguments from `defaults` and the switches' attributes as they are now."""
        kwargs = {**self.defaults, **{name: getattr(self, name) for name in self._switch_names}}
        if "beta1" in kwargs:
            kwargs["betas"] = (kwargs.pop("beta1"), kwargs.pop("beta2"))
        for name in _UNUSED:
            kwargs.pop(name, None)
        return kwargs

    def step(self, gradients: list[torch.Tensor | None]) -> None:
        """Step every parameter of the group whose gradient (same position in `gradients`) is not None."""
        params = self.param_group["params"]
        if len(params) != len(gradients):
            raise ValueError(f"the gradients passed in does not equal to the size of the parameters! Params "
                             f"length: {len(params)}. Gradients length: {len(gradients)}")
        self._step([(p, g) for p, g in zip(params, gradients, strict=True) if g is not None])

    def step_param(self, param: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Step one parameter with its gradient (None: nothing to do); it need not be in the group."""
        if grad is not None:
            self._step([(param, grad)])

    def _step(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not pairs:
            return
        # The optimizer steps aliases of the parameters (their storage, not their `.grad`), each given its
        # gradient: a parameter's own `.grad`, which a trainer's backward may be writing meanwhile, is never
        # touched. Steps from several threads take turns on the one optimizer.
        aliases = [param.detach() for param, _ in pairs]
        with self._lock:
            for alias, (param, grad) in zip(aliases, pairs, strict=True):
                if param not in self.state:
                    self.state[param] = self._initial_state(param)
                alias.grad = grad
            group = self._optim.param_groups[0]
            group.update(self._optim_kwargs())  # `defaults` may have been changed since
            group["params"] = aliases
            # The same dicts as `self.state`'s: what the step writes there is the parameters' state.
            self._optim.state = {alias: self.state[param] for alias, (param, _) in zip(aliases, pairs, strict=True)}
            try:
                self._optim.step()
            finally:
                group["params"], self._optim.state = [], {}

    def _initial_state(self, param: torch.Tensor) -> dict[str, Any]:
        """The state torch.optim gives a parameter when it is first seen: empty (filled at its first step),
        except for Adagrad, which fills it at construction."""
        if self._cls is not optim.Adagrad:
            return {}
        # A detached alias, as the steps use: torch.optim refuses a non-leaf tensor, which a parameter stepped
        # functionally may be. The state is new tensors (zeros_like and the like), tied to no alias.
        alias = param.detach()
        return optim.Adagrad([alias], **self._optim_kwargs()).state[alias]


def as_functional_optim(optim_cls: type, *args: Any, **kwargs: Any) -> FunctionalOptimizer:
    """The functional counterpart of `optim_cls` (Adagrad, Adam, AdamW, SGD, Adadelta, RMSprop, Rprop, Adamax)
    with an empty param group, made with the functional constructor's arguments; ValueError for others."""
    return FunctionalOptimizer(optim_cls, [], *args, _allow_empty_param_list=True, **kwargs)
