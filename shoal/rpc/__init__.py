"""Remote procedure calls and remote references between workers, over shoal's authenticated transport."""

from shoal.rpc import functions
from shoal.rpc.api import get_worker_info, init_rpc, remote, rpc_async, rpc_sync, shutdown
from shoal.rpc.future import Future
from shoal.rpc.message import RemoteError, RemoteTraceback, UnknownFunctionError
from shoal.rpc.options import BackendType, RpcBackendOptions, TensorPipeRpcBackendOptions, WorkerInfo
from shoal.rpc.rref import RRef

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
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
