"""`RemoteModule`: a module that lives on another worker and is called like a local one; its
forward runs there, inside the caller's distributed autograd context, so gradients flow back."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.rpc import api as rpc
from shoal.rpc.future import Future
from shoal.rpc.rref import RRef


def _instantiate(module_cls: type[nn.Module], args: tuple, kwargs: dict) -> nn.Module:
    return module_cls(*args, **kwargs)


def _forward(module_rref: RRef, args: tuple, kwargs: dict) -> Any:
    return module_rref.local_value()(*args, **kwargs)


def _parameter_rrefs(module_rref: RRef, recurse: bool) -> list[RRef]:
    return [RRef(param) for param in module_rref.local_value().parameters(recurse)]


def _parse_remote_device(remote_device: str) -> tuple[str | int, str]:
    """"worker1/cpu" or "rank:1/cpu" -> (worker, device); the device defaults to the CPU."""
    on, _, device = remote_device.partition("/")
    device = device or "cpu"
    if not on:
        raise ValueError(f"remote_device {remote_device!r} names no worker; write 'worker_name/cpu' or 'rank:1/cpu'")
    if torch.device(device).type != "cpu":
        raise ValueError(f"remote_device {remote_device!r}: shoal's RPC moves CPU tensors only, so a RemoteModule "
                         f"lives on the CPU of its worker (write '{on}/cpu')")
    if on.startswith("rank:"):
        return int(on.removeprefix("rank:")), device
    return on, device


class RemoteModule(nn.Module):
    """`RemoteModule("worker1/cpu", nn.Linear, args=(16, 4))` builds `nn.Linear(16, 4)` on worker1;
    `forward(x)` (or calling it) runs it there and returns the output, `forward_async(x)` returns a
    Future of it. `remote_parameters()` gives RRefs for a DistributedOptimizer and
    `get_module_rref()` the module itself. It holds no parameters locally, so the methods that
    would act on local parameters or move the module raise instead of silently doing nothing.
    `rebuild_on(worker)` builds it again elsewhere (its owner lost), and this RemoteModule calls
    that one from then on (copies of it sent to other workers before do not follow)."""

    def __init__(self, remote_device: str, module_cls: type[nn.Module], args: tuple | None = None,
                 kwargs: dict[str, Any] | None = None) -> None:
        super().__init__()
        self._built_by = (module_cls, tuple(args or ()), dict(kwargs or {}))  # as given now, for rebuild_on
        self.on, self.device = _parse_remote_device(remote_device)
        self.module_rref: RRef = self._build(self.on)

    def _build(self, on: str | int) -> RRef:
        module_rref = rpc.remote(on, _instantiate, args=self._built_by)
        module_rref.confirmed().wait()  # the constructor's error, if any, belongs here
        return module_rref

    def rebuild_on(self, worker: str | int) -> None:
        """Build the module again on `worker`, as its constructor makes it (its state is the caller's
        to restore), and call that one from now on. For a module whose owner is lost: the old one is
        not copied, and the old RRef is dropped."""
        self.module_rref, self.on = self._build(worker), worker

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return rpc.rpc_sync(self.on, _forward, args=(self.module_rref, args, kwargs))

    def forward_async(self, *args: Any, **kwargs: Any) -> Future:
        return rpc.rpc_async(self.on, _forward, args=(self.module_rref, args, kwargs))

    def remote_parameters(self, recurse: bool = True) -> list[RRef]:
        return rpc.rpc_sync(self.on, _parameter_rrefs, args=(self.module_rref, recurse))

    def get_module_rref(self) -> RRef:
        return self.module_rref

    def _not_here(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"a RemoteModule keeps its module on {self.on!r}, so this method would act on an empty "
                           f"local shell: use remote_parameters(), or call the module's own method through "
                           f"get_module_rref() (for instance module.get_module_rref().rpc_sync().train())")

    parameters = named_parameters = buffers = named_buffers = _not_here
    state_dict = load_state_dict = to = cuda = cpu = type = float = double = half = bfloat16 = _not_here
    register_parameter = register_buffer = zero_grad = share_memory = requires_grad_ = train = eval = _not_here
