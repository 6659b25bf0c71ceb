"""torch.distributed.rpc-style functions over this worker's RPC agent (`from shoal import rpc`).

```python
rpc.init_rpc("trainer0", rank=0, world_size=2)          # env:// by default, as process groups
y = rpc.rpc_sync("ps", torch.add, args=(x, 1))          # run torch.add on worker "ps", wait
fut = rpc.rpc_async("ps", torch.add, args=(x, 1))       # a Future: fut.wait(), fut.then(...)
model = rpc.remote("ps", Net, args=(10,))               # an RRef to a Net that lives on "ps"
out = model.rpc_sync().forward(x)                       # call its method there
rpc.shutdown()                                          # waits for every worker's calls to finish
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shoal.observe import timeline
from shoal.rpc import backend_registry, current
from shoal.rpc.current import current_agent
from shoal.rpc.future import Future
from shoal.rpc.options import RpcBackendOptions, Timeout, To, WorkerInfo
from shoal.rpc.rref import RRef


def init_rpc(name: str, backend: backend_registry.BackendType | None = None, rank: int | None = None,
             world_size: int | None = None, rpc_backend_options: RpcBackendOptions | None = None) -> None:
    """Join the RPC group as worker `name`; returns once every worker has joined. The arguments are
    torch.distributed.rpc's, in its order (`backend` may only name TENSORPIPE, which shoal's agent
    stands in for).

    Rank and world size default to the RANK and WORLD_SIZE variables, as for process groups; a
    process group may use the same MASTER_ADDR:MASTER_PORT. With no world size, rank 0 starts a group
    of one, and any other worker joins the group that runs there (its rank the one given, or the next
    free one), returning once it is connected to every member. Where SHOAL_TRACE names a directory
    (`shoal run --trace DIR`), this process's timeline starts here.
    """
    running = current.current_or_none()
    if running is not None:
        raise RuntimeError(f"RPC is already initialized on this worker (as {running.name!r}); "
                           f"call shoal.rpc.shutdown() first")
    backend = backend if backend is not None else backend_registry.BackendType.TENSORPIPE
    if not backend_registry.is_shoal_backend(backend):
        raise ValueError(f"init_rpc: backend {backend!r} cannot carry shoal's calls; leave it out (shoal's own "
                         f"agent stands in for BackendType.TENSORPIPE)")
    options = rpc_backend_options or backend_registry.construct_rpc_backend_options(backend)
    options.check()
    timeline.start_from_environment()
    backend_registry.init_backend(backend, name=name, rank=-1 if rank is None else rank, world_size=world_size,
                                  rpc_backend_options=options)


def shutdown(graceful: bool = True, timeout: Timeout = None) -> None:
    """Leave the RPC group. Graceful (the default): first wait until every worker's outstanding calls
    are done, serving the others meanwhile; `timeout` (seconds or a timedelta) bounds that wait."""
    agent = current_agent()
    try:
        agent.shutdown(graceful, None if timeout is None else agent.timeout_seconds(timeout))
    finally:
        current.set_current(None)


def get_worker_info(worker_name: str | int | None = None) -> WorkerInfo:
    """The WorkerInfo of the worker with this name (or rank); of this worker without an argument."""
    agent = current_agent()
    return agent.info if worker_name is None else agent.worker(worker_name)


def lost_workers() -> list[WorkerInfo]:
    """The workers this worker knows to have died or left (shoal's; torch.distributed.rpc has no such
    call): a program that goes on without them, or rebuilds what they held, asks here which they are."""
    return current_agent().lost_workers()


def rpc_async(to: To, func: Callable, args: tuple = (), kwargs: dict | None = None,
              timeout: Timeout = None) -> Future:
    """Run `func(*args, **kwargs)` on worker `to`; a Future of its result.

    The future fails with the remote exception (its traceback attached as `__cause__`), with
    TimeoutError after `timeout` seconds (default: the backend's rpc_timeout), or with PeerFailure
    if the worker dies or leaves first.
    """
    return current_agent().call(to, func, args, kwargs, timeout)


def rpc_sync(to: To, func: Callable, args: tuple = (), kwargs: dict | None = None, timeout: Timeout = None) -> Any:
    """Run `func(*args, **kwargs)` on worker `to` and return its result (see rpc_async for errors)."""
    return rpc_async(to, func, args, kwargs, timeout).wait()


def remote(to: To, func: Callable, args: tuple = (), kwargs: dict | None = None, timeout: Timeout = None) -> RRef:
    """Run `func(*args, **kwargs)` on worker `to` and keep the result there; returns an RRef to it
    at once. Errors surface from `to_here()` and `confirmed()`."""
    return current_agent().remote(to, func, args, kwargs, timeout)
