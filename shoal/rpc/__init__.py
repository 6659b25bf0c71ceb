"""Remote procedure calls and remote references between workers, over shoal's authenticated transport.

The registry of RPC backends is `shoal.rpc.backend_registry`, as torch's is torch.distributed.rpc.backend_registry
(torch's `__all__` names its functions, but they are not attributes of torch.distributed.rpc itself)."""

from shoal.rpc import backend_registry, functions
from shoal.rpc.api import get_worker_info, init_rpc, lost_workers, remote, rpc_async, rpc_sync, shutdown
from shoal.rpc.future import Future
from shoal.rpc.message import RemoteError, RemoteTraceback, UnknownFunctionError
from shoal.rpc.options import RpcBackendOptions, TensorPipeRpcBackendOptions, WorkerInfo
from shoal.rpc.rref import RRef


def is_available() -> bool:
    """Whether RPC is usable here (torch's question): shoal's agent always is."""
    return True


def __getattr__(name: str):
    """`BackendType` is the registry's latest enum: `register_backend` makes a new one, as torch's does."""
    if name == "BackendType":
        return backend_registry.BackendType
    raise AttributeError(f"module 'shoal.rpc' has no attribute {name!r}")


__all__ = [
    "BackendType",
    "Future",
    "RRef",
    "RemoteError",
    "RemoteTraceback",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "UnknownFunctionError",
    "WorkerInfo",
    "functions",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "lost_workers",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
