"""Who a worker is (`WorkerInfo`) and how the RPC agent is set up (`RpcBackendOptions`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class WorkerInfo:
    """A worker of the RPC group: its unique name and its rank (`id`). Usable as `to`."""

    name: str
    id: int


@dataclass(kw_only=True)
class RpcBackendOptions:
    """Settings of the RPC agent, as torch.distributed.rpc's backend options name them."""

    init_method: str = "env://"
    """Rendezvous, as for process groups: env:// (MASTER_ADDR, MASTER_PORT) or tcp://host:port."""
    rpc_timeout: float = 60.0
    """Seconds a call may take before its future fails with TimeoutError (a call's `timeout` overrides)."""
    num_worker_threads: int = 16
    """Threads that run incoming calls; a call that makes a nested call holds its thread meanwhile."""
    init_timeout: float = 300.0
    """Seconds to wait for every worker to join in init_rpc."""
    shutdown_timeout: float = 300.0
    """Seconds a graceful shutdown waits for the other workers to finish their work."""

    def __post_init__(self) -> None:
        for name in ("rpc_timeout", "init_timeout", "shutdown_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RpcBackendOptions.{name} must be a positive number of seconds, "
                                 f"got {getattr(self, name)!r}")
        if self.num_worker_threads < 1:
            raise ValueError(f"RpcBackendOptions.num_worker_threads must be at least 1, got {self.num_worker_threads}")


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
