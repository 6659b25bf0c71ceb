"""Who a worker is (`WorkerInfo`, and `To`, how a call names one) and how the RPC agent is set up
(`RpcBackendOptions`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch


@dataclass(frozen=True)
class WorkerInfo:
    """A worker of the RPC group: its unique name and its rank (`id`). Usable as `to`."""

    name: str
    id: int


To = str | int | WorkerInfo
"""How a call names its worker: by name, by rank, or by WorkerInfo."""


@dataclass(kw_only=True)
class RpcBackendOptions:
    """Settings of the RPC agent, as torch.distributed.rpc's backend options name them."""

    init_method: str = "env://"
    """Rendezvous: env:// (MASTER_ADDR, MASTER_PORT) or tcp://host:port."""
    rpc_timeout: float = 60.0
    """Seconds a call may take before its future fails with TimeoutError (a call's `timeout` overrides)."""
    num_worker_threads: int = 16
    """Threads that run incoming calls; a call that makes a nested call holds its thread meanwhile."""
    init_timeout: float = 300.0
    """Seconds to wait for every worker to join in init_rpc."""
    shutdown_timeout: float = 300.0
    """Seconds a graceful shutdown waits for the other workers to finish their work."""
    device_maps: dict[str, dict] | None = None
    """TensorPipe's GPU device maps, accepted by name: shoal's RPC moves CPU tensors only, so only
    maps from the CPU to the CPU are valid."""
    devices: list | None = None
    """TensorPipe's list of local devices; likewise the CPU only."""

    def __post_init__(self) -> None:
        self.check()

    def set_device_map(self, to: str, device_map: dict) -> None:
        """As TensorPipe's: map this worker's devices to `to`'s (checked to be CPU-only at init_rpc)."""
        self.device_maps = {**(self.device_maps or {}), to: dict(device_map)}

    def check(self) -> None:
        """Raise ValueError for a setting shoal cannot honour; init_rpc checks again, since the
        fields may be set after construction, as TensorPipe's may."""
        for name in ("rpc_timeout", "init_timeout", "shutdown_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RpcBackendOptions.{name} must be a positive number of seconds, "
                                 f"got {getattr(self, name)!r}")
        if self.num_worker_threads < 1:
            raise ValueError(f"RpcBackendOptions.num_worker_threads must be at least 1, got {self.num_worker_threads}")
        named = [*(self.devices or [])]
        for device_map in (self.device_maps or {}).values():
            named += [*device_map.keys(), *device_map.values()]
        # A bare int means an accelerator's index; anything else names its type.
        not_cpu = sorted({str(device) for device in named
                          if isinstance(device, int) or torch.device(device).type != "cpu"})
        if not_cpu:
            raise ValueError(f"the RPC backend options name devices {not_cpu}, but shoal's RPC moves CPU tensors "
                             f"only: move tensors to the CPU before sending them (tensor.cpu()) and leave out "
                             f"device_maps and devices")


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """torch.distributed.rpc's name for the options, taking torch's arguments in torch's order, so scripts
    move over by changing the import; the same settings as RpcBackendOptions, honoured by shoal's own
    agent (`init_timeout` and `shutdown_timeout` may be set as attributes). `_transports` and `_channels`
    choose TensorPipe's internals; shoal's transport has one of each, so they are accepted and unused."""

    def __init__(self, num_worker_threads: int = 16, rpc_timeout: float = 60.0, init_method: str = "env://",
                 device_maps: dict[str, dict] | None = None, devices: list | None = None,
                 _transports: list | None = None, _channels: list | None = None) -> None:
        super().__init__(num_worker_threads=num_worker_threads, rpc_timeout=rpc_timeout, init_method=init_method,
                         device_maps=device_maps, devices=devices)


Timeout = float | timedelta | None
UNSET_RPC_TIMEOUT = -1.0
"""torch.distributed.rpc's marker for "the agent's default"; accepted here too."""


def timeout_seconds(timeout: Timeout, default: float) -> float:
    """A call's timeout in seconds: `default` for None (or UNSET_RPC_TIMEOUT), else a positive
    number of seconds or a timedelta. The one conversion every RPC timeout goes through."""
    if timeout is None or timeout == UNSET_RPC_TIMEOUT:
        return default
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"an RPC timeout must be a positive number of seconds, got {timeout!r}")
    return seconds
