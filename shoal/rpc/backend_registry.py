"""torch.distributed.rpc's registry of RPC backends by name (`BackendType`). shoal's agent is the backend
that carries shoal's calls; it stands under TensorPipe's name, TENSORPIPE. A script may register others,
as torch lets it: they get a BackendType member and their options handler works, but `init_rpc` refuses
them, since only shoal's agent can carry shoal's calls."""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from typing import Any

from shoal.rpc.agent import RpcAgent
from shoal.rpc.options import TensorPipeRpcBackendOptions

BackendValue = collections.namedtuple("BackendValue", ["construct_rpc_backend_options_handler",
                                                       "init_backend_handler"])


def _shoal_options(rpc_timeout: float, init_method: str, **kwargs: Any) -> TensorPipeRpcBackendOptions:
    return TensorPipeRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)


def _shoal_agent(store: object = None, name: str = "", rank: int = -1, world_size: int | None = None,
                 rpc_backend_options: TensorPipeRpcBackendOptions | None = None):
    """Start shoal's agent, as torch's handlers start theirs; it meets its peers through the options'
    init_method, so `store` goes unused."""
    return RpcAgent.start(name, None if rank == -1 else rank, world_size,
                          rpc_backend_options or TensorPipeRpcBackendOptions())


BackendType = enum.Enum("BackendType", {"TENSORPIPE": BackendValue(_shoal_options, _shoal_agent)})
BackendType.__doc__ = "torch.distributed.rpc's backend names; shoal's agent stands in for TENSORPIPE."


def backend_registered(backend_name: str) -> bool:
    return backend_name in BackendType.__members__


def register_backend(backend_name: str, construct_rpc_backend_options_handler: Callable[..., Any],
                     init_backend_handler: Callable[..., Any]) -> BackendType:
    """Add `backend_name` to BackendType (a new enum, as torch makes one), with its two handlers."""
    global BackendType
    if backend_registered(backend_name):
        raise RuntimeError(f"RPC backend {backend_name}: already registered")
    members = {member.name: member.value for member in BackendType}
    members[backend_name] = BackendValue(construct_rpc_backend_options_handler, init_backend_handler)
    doc = BackendType.__doc__
    BackendType = enum.Enum("BackendType", members)
    BackendType.__doc__ = doc
    return BackendType[backend_name]


def construct_rpc_backend_options(backend: BackendType, rpc_timeout: float = 60.0, init_method: str = "env://",
                                  **kwargs: Any) -> Any:
    """The options `backend` takes, built by its handler (TENSORPIPE: shoal's TensorPipeRpcBackendOptions)."""
    return backend.value.construct_rpc_backend_options_handler(rpc_timeout, init_method, **kwargs)


def init_backend(backend: BackendType, *args: Any, **kwargs: Any) -> Any:
    """Start `backend`'s agent through its handler (TENSORPIPE: shoal's)."""
    return backend.value.init_backend_handler(*args, **kwargs)


def is_shoal_backend(backend: object) -> bool:
    """Whether `backend` names shoal's agent: TENSORPIPE, of any BackendType a registration has made."""
    return getattr(backend, "name", None) == "TENSORPIPE"
