"""Remote references: `RRef`, a reference to an object that lives on one worker, usable from any, and
the proxies through which `rref.rpc_sync().method(...)` runs the object's methods on its owner. How
long the object lives is the RRef context's business (`rref_context.py`).

An RRef talks to the rest of RPC through a small public protocol: its agent's `RRefAgent` methods,
and the context's `own` and `release`. The context, in turn, makes RRefs with `make_rref` and reads
what it needs to fork one with `reference_of`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import torch

from shoal.rpc.current import current_agent
from shoal.rpc.functions import async_execution, is_async_execution
from shoal.rpc.future import Future

if TYPE_CHECKING:
    from shoal.rpc.headers import RRefId
    from shoal.rpc.options import Timeout, To, WorkerInfo
    from shoal.rpc.rref_context import Reference, RRefContext

T = TypeVar("T")


class RRefAgent(Protocol):
    """What an RRef asks of the RPC agent it belongs to (`RpcAgent` is the one implementation)."""

    name: str
    default_timeout: float
    rref_context: RRefContext

    def worker(self, to: To) -> WorkerInfo:
        """The worker `to` names."""

    def timeout_seconds(self, timeout: Timeout) -> float:
        """A call's timeout in seconds (the agent's default for None)."""

    def call(self, to: To, func: Any, args: tuple, kwargs: dict | None, timeout: Timeout) -> Future:
        """Run `func(*args, **kwargs)` on `to`; a future of its result."""

    def remote(self, to: To, func: Any, args: tuple, kwargs: dict | None, timeout: Timeout) -> RRef:
        """Run `func(*args, **kwargs)` on `to` and keep the result there; an RRef to it."""

    def fetch(self, owner: int, rref_id: RRefId, timeout: Timeout) -> Future:
        """A copy of the object `rref_id` from its owner."""


class RRef(Generic[T]):
    """A reference to an object that lives on one worker (its owner), usable from any worker.

    `RRef(value)` makes this worker the owner of `value`; `shoal.rpc.remote()` creates an object on
    another worker and returns a reference to it. Pass RRefs as arguments or results of RPCs.
    """

    _is_shoal_rref = True  # recognized by the message pickler without importing this module there

    def __init__(self, value: T) -> None:
        agent = current_agent()
        self._bind(agent, agent.rref_context.own(value), None)

    def _bind(self, agent: RRefAgent, reference: Reference, created: Future[None] | None) -> None:
        self._agent = agent
        self._reference = reference
        self._created = created  # the remote() call that creates the object, on the caller

    def owner(self) -> WorkerInfo:
        return self._agent.worker(self._reference.owner)

    def owner_name(self) -> str:
        return self.owner().name

    def is_owner(self) -> bool:
        return self._reference.entry is not None

    def local_value(self) -> T:
        """The object itself; only its owner has it."""
        entry = self._reference.entry
        if entry is None:
            raise RuntimeError(f"local_value() is for the owner of an RRef ({self.owner_name()!r}); worker "
                               f"{self._agent.name!r} holds a reference only: use to_here() to fetch a copy")
        return entry.value.wait(self._agent.default_timeout)

    def to_here(self, timeout: Timeout = None) -> T:
        """A copy of the object (the object itself on its owner); raises what creating it raised."""
        owner, rref_id, _, entry = self._reference
        if entry is not None:
            return entry.value.wait(self._agent.timeout_seconds(timeout))
        return self._agent.fetch(owner, rref_id, timeout).wait()

    def confirmed(self) -> Future[None]:
        """Completes once the owner has created the object (at once for RRefs made another way)."""
        if self._created is not None:
            return self._created
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def rpc_sync(self, timeout: Timeout = None) -> Any:
        """`rref.rpc_sync().method(*args)` runs `method` on the object, on its owner, and waits."""
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: Timeout = None) -> Any:
        """`rref.rpc_async().method(*args)` returns a Future of the method's result."""
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: Timeout = None) -> Any:
        """`rref.remote().method(*args)` returns an RRef to the method's result, kept on the owner."""
        return _Proxy(self, "remote", timeout)

    def __reduce__(self) -> Any:
        raise TypeError("an RRef travels only inside RPC arguments and results, not through plain pickle")

    def __repr__(self) -> str:
        role = "owner" if self.is_owner() else "user"
        return f"RRef({role}, owner={self._reference.owner}, id={self._reference.rref_id})"

    def __del__(self) -> None:
        reference = getattr(self, "_reference", None)  # None if __init__ failed
        if reference is not None and reference.fork_id is not None:  # a holder's fork: its owner counts it
            self._agent.rref_context.release(reference)


def make_rref(agent: RRefAgent, reference: Reference, created: Future[None] | None = None) -> RRef:
    """The RRef of `reference`, bound to `agent` (for the RRef context: users make theirs with `RRef(value)`
    or `remote()`); `created` is the remote() call that creates its object, on the caller."""
    rref: RRef = RRef.__new__(RRef)
    rref._bind(agent, reference, created)
    return rref


def reference_of(rref: RRef) -> Reference:
    """What the fork protocol knows of `rref`."""
    return rref._reference


class _Proxy:
    """Turns `proxy.name(*args)` into a call of the method `name` of the RRef's object on its owner,
    through the agent the RRef belongs to."""

    def __init__(self, rref: RRef, mode: str, timeout: Timeout) -> None:
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            rref = self._rref
            agent, owner = rref._agent, rref._reference.owner
            method_args = (rref, name, args, kwargs)
            if self._mode == "remote":
                return agent.remote(owner, invoke_method, method_args, None, self._timeout)
            future = agent.call(owner, invoke_method, method_args, None, self._timeout)
            return future.wait() if self._mode == "rpc_sync" else future

        return call


@async_execution
def invoke_method(rref: RRef, name: str, args: tuple, kwargs: dict) -> torch.futures.Future:
    """Runs on the owner: the method `name` of the referenced object. Answers through a future, so
    that an @async_execution method answers when its own future completes."""
    method = getattr(rref.local_value(), name)
    result = method(*args, **kwargs)
    if is_async_execution(method):
        return result
    done: Future[Any] = Future()
    done.set_result(result)
    return done
