"""Remote references: `RRef`, and the owner's table that keeps a referenced object alive exactly
as long as some worker holds a reference to it.

The protocol follows PyTorch's reference counting with forks. The owner keeps each object with the
set of forks (user references on other workers) that point to it and frees it when the set is
empty and no local RRef is left. A worker that passes an RRef to another creates a fork. If the
worker owns the object, it records the fork in its table. Otherwise it first sends "add fork" to
the owner, on the same ordered connection that later carries its own "delete". The owner thus
learns of the child before it can forget the parent. A child's delete may overtake its own "add"
(they travel on different connections), so an unmatched delete is remembered as a tombstone and
cancels the add when that arrives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from shoal.rpc.current import current_agent
from shoal.rpc.functions import async_execution, is_async_execution
from shoal.rpc.future import Future
from shoal.rpc.headers import ForkId, RRefId

if TYPE_CHECKING:
    from shoal.rpc.agent import RpcAgent
    from shoal.rpc.options import Timeout, WorkerInfo

T = TypeVar("T")


class Owned:
    """An object this worker owns on behalf of RRefs: its value (a future, as a remote() call may
    still be computing it) and the forks that hold it."""

    __slots__ = ("created", "forks", "rref_id", "value")

    def __init__(self, rref_id: RRefId) -> None:
        self.rref_id = rref_id
        self.value: Future[Any] = Future()
        self.forks: dict[ForkId, int] = {}  # fork -> rank holding it
        # False while only a fetch has named this id: the remote() call creating it is on its way.
        self.created = False


class OwnerTable:
    """The objects this worker owns that other workers reference."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[RRefId, Owned] = {}
        self._tombstones: set[tuple[RRefId, ForkId]] = set()

    def local(self, rref_id: RRefId, value: Any) -> Owned:
        """An entry for `RRef(value)`: held by the local RRef only, until it is first forked."""
        entry = Owned(rref_id)
        entry.created = True
        entry.value.set_result(value)
        return entry

    def entry(self, rref_id: RRefId) -> Owned:
        """The entry for `rref_id`, or a placeholder its creating remote() call will fill: a fetch, or
        a reference a holder sends home, can overtake that call (they travel on different connections)."""
        with self._lock:
            entry = self._entries.get(rref_id)
            if entry is None:
                entry = self._entries[rref_id] = Owned(rref_id)
            return entry

    def created_remotely(self, rref_id: RRefId, fork_id: ForkId, holder: int) -> Owned:
        """A remote() call arrived: the entry exists from now on, held by the caller's fork."""
        entry = self.entry(rref_id)
        with self._lock:
            entry.created = True
        self.add_fork(entry, fork_id, holder)
        return entry

    def add_fork(self, entry: Owned | RRefId, fork_id: ForkId, holder: int) -> None:
        with self._lock:
            if not isinstance(entry, Owned):
                entry = self._entries.setdefault(entry, Owned(entry))
            key = (entry.rref_id, fork_id)
            if key in self._tombstones:  # its delete overtook this add
                self._tombstones.discard(key)
            else:
                entry.forks[fork_id] = holder
                self._entries[entry.rref_id] = entry
            self._release_if_unheld(entry)

    def delete_fork(self, rref_id: RRefId, fork_id: ForkId) -> None:
        with self._lock:
            entry = self._entries.get(rref_id)
            if entry is None or fork_id not in entry.forks:
                self._tombstones.add((rref_id, fork_id))
                return
            del entry.forks[fork_id]
            self._release_if_unheld(entry)

    def drop_holder(self, rank: int) -> None:
        """A worker is gone: the references it held are gone with it."""
        with self._lock:
            for entry in list(self._entries.values()):
                for fork in [f for f, holder in entry.forks.items() if holder == rank]:
                    del entry.forks[fork]
                self._release_if_unheld(entry)

    def _release_if_unheld(self, entry: Owned) -> None:
        # Local RRefs keep the entry object (and so the value) alive on their own.
        if entry.created and not entry.forks:
            self._entries.pop(entry.rref_id, None)

    def __len__(self) -> int:
        """How many objects other workers hold references to."""
        with self._lock:
            return len(self._entries)


class RRef(Generic[T]):
    """A reference to an object that lives on one worker (its owner), usable from any worker.

    `RRef(value)` makes this worker the owner of `value`; `shoal.rpc.remote()` creates an object on
    another worker and returns a reference to it. Pass RRefs as arguments or results of RPCs.
    """

    _is_shoal_rref = True  # recognized by the message pickler without importing this module there

    def __init__(self, value: T) -> None:
        agent = current_agent()
        entry = agent.rrefs.local(agent.new_id(), value)
        self._set(agent, agent.rank, entry.rref_id, None, entry)

    @classmethod
    def _make(cls, agent: RpcAgent, owner: int, rref_id: RRefId, fork_id: ForkId | None,
              entry: Owned | None, created: Future[None] | None = None) -> RRef:
        rref = cls.__new__(cls)
        rref._set(agent, owner, rref_id, fork_id, entry, created)
        return rref

    def _set(self, agent: RpcAgent, owner: int, rref_id: RRefId, fork_id: ForkId | None, entry: Owned | None,
             created: Future[None] | None = None) -> None:
        self._agent = agent
        self._owner = owner
        self._rref_id = entry.rref_id if entry is not None else rref_id
        self._fork_id = fork_id  # None on the owner
        self._entry = entry  # the owned object, on the owner only
        self._created = created  # the remote() call that creates the object, on the caller

    def owner(self) -> WorkerInfo:
        return self._agent.worker(self._owner)

    def owner_name(self) -> str:
        return self.owner().name

    def is_owner(self) -> bool:
        return self._entry is not None

    def local_value(self) -> T:
        """The object itself; only its owner has it."""
        if self._entry is None:
            raise RuntimeError(f"local_value() is for the owner of an RRef ({self.owner_name()!r}); worker "
                               f"{self._agent.name!r} holds a reference only: use to_here() to fetch a copy")
        return self._entry.value.wait(self._agent.default_timeout)

    def to_here(self, timeout: Timeout = None) -> T:
        """A copy of the object (the object itself on its owner); raises what creating it raised."""
        if self._entry is not None:
            return self._entry.value.wait(self._agent.timeout_seconds(timeout))
        return self._agent.fetch(self, timeout).wait()

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
        return f"RRef({role}, owner={self._owner}, id={self._rref_id})"

    def __del__(self) -> None:
        if getattr(self, "_fork_id", None) is not None:
            self._agent.release(self._owner, self._rref_id, self._fork_id)


class _Proxy:
    """Turns `proxy.name(*args)` into a call of the method `name` of the RRef's object on its owner,
    through the agent the RRef belongs to."""

    def __init__(self, rref: RRef, mode: str, timeout: Timeout) -> None:
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            rref, agent = self._rref, self._rref._agent
            method_args = (rref, name, args, kwargs)
            if self._mode == "remote":
                return agent.remote(rref._owner, invoke_method, method_args, None, self._timeout)
            future = agent.call(rref._owner, invoke_method, method_args, None, self._timeout)
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
