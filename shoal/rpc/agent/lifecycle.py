"""`RpcAgent`, one worker's end of the RPC group, from start to shutdown: it starts the group with
the others or joins it while it runs, puts together the pieces that call out, serve and send
notices, names the workers, answers a worker's death, and shuts down in step with the other workers
(or, having joined, leaves)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from shoal import config
from shoal.backoff import attempts
from shoal.comm import rendezvous
from shoal.comm.transport import Transport, connect, listen
from shoal.errors import PeerFailure
from shoal.rpc import autograd_contexts, current
from shoal.rpc.agent import joining
from shoal.rpc.agent.calls import Caller
from shoal.rpc.agent.members import Members, welcome
from shoal.rpc.agent.notices import Notices
from shoal.rpc.agent.outstanding import Outstanding
from shoal.rpc.agent.pool import WorkerPool
from shoal.rpc.agent.running import Runner
from shoal.rpc.agent.serving import Server
from shoal.rpc.agent.wire import Wire
from shoal.rpc.future import Future
from shoal.rpc.headers import ForkChange, Kind, RRefId
from shoal.rpc.message import Encoded
from shoal.rpc.options import RpcBackendOptions, Timeout, To, WorkerInfo, timeout_seconds
from shoal.rpc.rref import RRef, make_rref
from shoal.rpc.rref_context import RRefContext

log = logging.getLogger(__name__)


class RpcAgent:
    """One worker's end of the RPC group (see `shoal.rpc` for the user-facing functions)."""

    def __init__(self, info: WorkerInfo, workers: list[WorkerInfo], transport: Transport, store: Any,
                 options: RpcBackendOptions, *, world_size: int, joined: bool = False) -> None:
        self.info, self.rank, self.name = info, info.id, info.name
        self.members = Members(workers, store, world_size)  # the name table, which follows joiners
        self._joined = joined  # it joined the running group: it leaves alone
        self.transport, self.store, self.options = transport, store, options
        self.default_timeout = options.rpc_timeout
        self._ids = itertools.count()  # message ids, and the numbers of the ids new_id() draws
        self._gone: set[int] = set()
        self._loss_listeners: list[Callable[[WorkerInfo], None]] = []
        self._outstanding = Outstanding(self.name, self._worker_name)
        self._pool = WorkerPool(options.num_worker_threads, f"shoal-rpc-{self.name}")
        self._wire = Wire(transport, timedelta(seconds=options.rpc_timeout), self.name)
        self.rref_context = RRefContext(self.rank, self.new_id, self._tell_owner,
                                        lambda reference, created: make_rref(self, reference, created), self.name)
        runner = Runner(self.name, pool=self._pool, outstanding=self._outstanding)
        self._notices = Notices(self.name, wire=self._wire, ids=self._ids, rrefs=self.rref_context, runner=runner)
        self._caller = Caller(self.rank, self.default_timeout, self._worker_name, wire=self._wire, ids=self._ids,
                              new_id=self.new_id, rrefs=self.rref_context, outstanding=self._outstanding,
                              runner=runner, notices=self._notices)
        server = Server(self.name, wire=self._wire, rrefs=self.rref_context, runner=runner, notices=self._notices)
        self._wire.handle(Kind.REQUEST, server.on_request)
        self._wire.handle(Kind.RESPONSE, self._caller.on_response)
        self._wire.handle(Kind.CONTROL, lambda src, msg_id, change, body, tensors: self.rref_context.on_change(change))
        self._wire.handle(Kind.NOTICE, self._notices.on_notice)
        transport.on_peer_failure(self._on_peer_failure)

    @classmethod
    def start(cls, name: str, rank: int | None, world_size: int | None, options: RpcBackendOptions) -> RpcAgent:
        """Rendezvous, connect to every other worker, and return once all of them are ready. Without a
        world size, rank 0 starts a group of one, and any other worker joins the group that runs."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"init_rpc: the worker name must be a non-empty string, got {name!r}")
        timeout = timedelta(seconds=options.init_timeout)
        if not rendezvous.world_size_given(options.init_method, world_size):
            if rank is None and options.init_method.startswith("env://"):
                rank = config.RANK.get()
            if rank != 0:
                return cls._join(name, rank, options, time.monotonic() + timeout.total_seconds())
            world_size = 1
        endpoint = rendezvous.resolve(options.init_method, rank, world_size)
        rank, world_size = endpoint.rank, endpoint.world_size
        # A namespace of its own: a process group may share this store (and its server).
        store = rendezvous.join(endpoint, timeout, namespace="shoal-rpc/")
        transport, entries = listen(store, rank, world_size, toward=endpoint.host, timeout=timeout,
                                    stall_timeout=timedelta(seconds=options.rpc_timeout), card=(name,),
                                    open_membership=True, every_interface=False)  # RPC keeps to one connection
        agent: RpcAgent | None = None
        try:
            store.set(f"named/{rank}", 1)
            names = [entry[0] for entry in entries]
            if names.count(name) > 1:
                if rank == 0:  # it may serve the store: stay until every worker has read the names
                    store.wait([f"named/{r}" for r in range(world_size)], timeout=timeout)
                raise ValueError(f"init_rpc: worker name {name!r} is taken by ranks "
                                 f"{[r for r, n in enumerate(names) if n == name]}; every worker needs its own name")
            workers = [WorkerInfo(n, r) for r, n in enumerate(names)]
            agent = cls(workers[rank], workers, transport, store, options, world_size=world_size)
            autograd_contexts.contexts.started(rank)
            current.set_current(agent)  # calls may arrive as soon as we connect, before init_rpc returns
            connect(transport, entries, timeout)
            # Nobody sends before every agent listens for RPC frames.
            store.set(f"ready/{rank}", 1)
            store.wait([f"ready/{r}" for r in range(world_size)], timeout=timeout)
            if rank == 0:  # where workers that join find this start of the group
                base = rendezvous.connection(endpoint, timeout)
                base.set(joining.RUNNING, store.prefix.removeprefix(base.prefix))
        except BaseException:
            current.set_current(None)
            if agent is not None:
                agent._tear_down(None)  # its threads too, not only the transport
            else:
                transport.close()
            raise
        return agent

    @classmethod
    def _join(cls, name: str, rank: int | None, options: RpcBackendOptions, deadline: float) -> RpcAgent:
        """Join the group that runs at the store of `options.init_method` (joining.py), as `rank` or
        the next free rank, by `deadline`; return once connected to every member that lives."""
        host, port = rendezvous.store_address(options.init_method)
        store, world_size, entries = joining.find_group(host, port, deadline)
        rank = joining.claim(store, name, rank, world_size, entries)
        agent: RpcAgent | None = None
        transport = None
        try:
            transport, _ = listen(store, rank, world_size, toward=host, timeout=joining.left(deadline),
                                  stall_timeout=timedelta(seconds=options.rpc_timeout), card=(name,),
                                  open_membership=True, every_interface=False)
            info = WorkerInfo(name, rank)
            workers = [WorkerInfo(entry[0], r) for r, entry in enumerate(entries)] + [info]
            agent = cls(info, workers, transport, store, options, world_size=world_size, joined=True)
            autograd_contexts.contexts.started(rank)
            current.set_current(agent)  # before it registers: later joiners dial it from then on
            earlier = joining.register(store, rank, deadline)  # dialled; named once they finish joining
            members = [*enumerate(entries), *earlier.items()]
            for member, entry in members:
                transport.dial_member(member, (entry[-2], entry[-1]), joining.left(deadline))
            if all(agent.is_lost(member) for member in range(world_size)):
                raise RuntimeError(f"init_rpc: the RPC group at {host}:{port} has ended: none of the workers "
                                   f"that started it is left")
            store.set(f"ready/{rank}", 1)
            store.set(f"names/{name}", rank)  # from here the others find it by name
            for member, _ in members:  # by rank: an earlier joiner may not have finished joining
                try:
                    agent._notices.notify(member, welcome, (name, rank))
                except PeerFailure:  # lost: it needs no name
                    continue
        except BaseException:
            current.set_current(None)
            if agent is not None:
                agent._tear_down(None)
            elif transport is not None:
                transport.close()
            try:
                joining.release(store, name, rank)
            except Exception:  # the join's own error is the one to raise
                log.exception("worker %r: could not free its name and rank after a failed join", name)
            raise
        return agent

    # ---- names and ids -----------------------------------------------------------------------

    def worker(self, to: To) -> WorkerInfo:
        """The worker `to` names: a name, a rank or a WorkerInfo (also one that joined since)."""
        if isinstance(to, WorkerInfo):
            if self.members.ranked(to.id) == to:
                return to
            raise ValueError(f"{to} is not a worker of this RPC group (the workers are {self.members.names()})")
        if isinstance(to, str):
            if (found := self.members.named(to)) is None:
                raise ValueError(f"no worker is named {to!r}; the workers are {self.members.names()}")
            return found
        if isinstance(to, int) and not isinstance(to, bool):
            if (found := self.members.ranked(to)) is None:
                raise ValueError(f"no worker has rank {to}; the workers are {self.members.names()}")
            return found
        raise TypeError(f"a worker is named by its name, rank or WorkerInfo, not {type(to).__name__}")

    def _worker_name(self, rank: int) -> str:
        return self.members.info(rank).name

    def is_lost(self, to: To) -> bool:
        """Whether worker `to` has crashed or left: calls to it fail at once with PeerFailure."""
        return self.worker(to).id in self._gone

    def lost_workers(self) -> list[WorkerInfo]:
        return [self.members.info(rank) for rank in sorted(self._gone)]

    def new_id(self) -> tuple[int, int]:
        """An id no other worker can draw: (our rank, a number)."""
        return (self.rank, next(self._ids))

    def timeout_seconds(self, timeout: Timeout) -> float:
        return timeout_seconds(timeout, self.default_timeout)

    # ---- calls and notices (calls.py, notices.py) ----------------------------------------------

    def call(self, to: To, func: Any, args: tuple, kwargs: dict | None, timeout: Timeout) -> Future:
        return self._caller.call(self.worker(to).id, func, args, kwargs, timeout)

    def remote(self, to: To, func: Any, args: tuple, kwargs: dict | None, timeout: Timeout) -> RRef:
        return self._caller.remote(self.worker(to).id, func, args, kwargs, timeout)

    def fetch(self, owner: int, rref_id: RRefId, timeout: Timeout) -> Future:
        """A copy of a referenced object from its owner (`RRef.to_here`)."""
        return self._caller.fetch(owner, rref_id, timeout)

    def notify(self, to: To, func: Any, args: tuple) -> None:
        """Run `func(*args)` on worker `to` without waiting for it or hearing how it went (errors are
        logged there): for bookkeeping that must not cost a round trip. PeerFailure if `to` is
        known to be gone; nothing tells whether it ran if `to` dies or leaves meanwhile."""
        self._notices.notify(self.worker(to).id, func, args)

    def notify_soon(self, to: To, func: Any, args: tuple) -> None:
        """`notify`, later: the notice rides on the next request or notice this worker sends to `to`,
        or goes alone after a few milliseconds (riders.py). Returns at once. No order is promised,
        among these notices or with other messages; `args` must be plain data (no tensors, no RRefs)."""
        self._notices.notify_soon(self.worker(to).id, func, args)

    def _tell_owner(self, owner: int, change: ForkChange) -> None:
        self._wire.send(owner, Kind.CONTROL, next(self._ids), change, Encoded(b""))

    # ---- failures and shutdown ---------------------------------------------------------------

    def on_worker_lost(self, listener: Callable[[WorkerInfo], None]) -> None:
        """Call `listener(worker)` once for each worker that dies or leaves from now on (`is_lost` tells
        of those before), after the calls to it have failed, on the thread that noticed: it must not block."""
        self._loss_listeners.append(listener)

    def _on_peer_failure(self, error: PeerFailure) -> None:
        rank = error.rank
        self._gone.add(rank)
        self._wire.forget(rank)
        self._notices.drop(rank)
        self._outstanding.fail_calls_to(rank, PeerFailure(rank, f"worker {self._worker_name(rank)!r}: {error.detail}"))
        self.rref_context.table.drop_holder(rank)
        autograd_contexts.contexts.peer_failed(rank)
        for listener in self._loss_listeners:
            try:
                listener(self.members.info(rank))
            except Exception:  # one listener's bug must not keep the loss from the others
                log.exception("worker %r: a listener for the loss of worker %r failed", self.name,
                              self._worker_name(rank))

    def shutdown(self, graceful: bool, timeout: float | None) -> None:
        """Graceful: wait for our calls, tell the others we are done, and keep serving theirs until
        every worker is done too; then tear down. Otherwise tear down at once."""
        everyone_done = False
        deadline = time.monotonic() + (timeout or self.options.shutdown_timeout)
        try:
            if graceful:
                self._outstanding.wait_idle(deadline)
                self._notices.flush(max(0.0, deadline - time.monotonic()))  # before we say we are done
                self.rref_context.flush(max(0.0, deadline - time.monotonic()))
                self._wait_for_everyone(deadline)
                everyone_done = True
        finally:
            # Past a deadline, calls may still be running here: the timeout bounds shutdown, so they
            # are left to finish on their own, or to end with the process (the pool's threads are
            # daemons: a call that never returns must not keep the interpreter from exiting).
            self._tear_down(deadline if everyone_done else None)

    def _wait_for_everyone(self, deadline: float) -> None:
        """Say this worker is done, and wait until every worker is; a worker that joined the running
        group leaves without waiting (the others see it leave, as if it had died)."""
        self.store.set(f"done/{self.rank}", 1)
        if not self._joined:
            self._wait_for_keys("done", deadline, "finish its RPCs")
        # Rank 0 serves the store when no launcher does: it leaves last, once nobody needs to read from it.
        self.store.set(f"left/{self.rank}", 1)
        if self.rank == 0:
            self._wait_for_keys("left", deadline, "leave")

    def _wait_for_keys(self, name: str, deadline: float, what: str) -> None:
        # Polled: a worker that dies meanwhile (it joins _gone) must not be waited for. With
        # backoff: a server may wait here for its trainers' whole run, and every poll is a request
        # to the store.
        for rank in self.members.ranks():
            for _ in attempts(deadline, first=0.005, limit=0.1, factor=1.5):
                if rank in self._gone or self.store.has(f"{name}/{rank}"):
                    break
            else:
                raise TimeoutError(f"worker {self.name!r}: worker {self._worker_name(rank)!r} did not "
                                   f"{what} before the shutdown deadline")

    def _tear_down(self, deadline: float | None) -> None:
        """Close everything; with a deadline, also wait until then for calls still being served."""
        self._outstanding.close()
        self._notices.stop(timeout=5.0)
        self.rref_context.stop(timeout=5.0)
        self.transport.close(timedelta(seconds=5))
        # Not cancelled: callbacks of the futures failed above are queued there, and a future's
        # callback must run (calls from others that are queued fail fast on the closed transport).
        self._pool.shutdown()
        autograd_contexts.contexts.stopped(deadline)
        if deadline is not None:
            # A call whose caller gave up may still run here; the deadline bounds shutdown all the same.
            self._pool.join(deadline)
