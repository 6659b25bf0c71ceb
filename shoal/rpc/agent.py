"""The RPC agent of one worker: it sends calls and answers over the wire and runs incoming calls on
a thread pool, and shuts down in step with the other workers. The calls it waits on live in
`outstanding.py`, the RRef fork protocol in `forks.py`."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from shoal.backoff import attempts
from shoal.comm import rendezvous
from shoal.comm.transport import Transport, connect, listen
from shoal.errors import GroupBrokenError, PeerFailure
from shoal.observe import events
from shoal.rpc import autograd_hook, current
from shoal.rpc.forks import Forks
from shoal.rpc.functions import is_async_execution, is_run_on_reader
from shoal.rpc.future import Future
from shoal.rpc.headers import AutogradTag, ForkChange, ForkId, FunctionRef, Kind, Mode, Request, Response, Rider, RRefId
from shoal.rpc.message import Encoded, decode, encode, function_ref, pack_error, resolve_function, unpack_error
from shoal.rpc.options import RpcBackendOptions, Timeout, WorkerInfo, timeout_seconds
from shoal.rpc.outstanding import Call, Outstanding
from shoal.rpc.pool import WorkerPool
from shoal.rpc.riders import Riders
from shoal.rpc.rref import Owned, OwnerTable, RRef
from shoal.rpc.wire import Wire

log = logging.getLogger(__name__)


def _outcome(done: torch.futures.Future) -> tuple[Any, BaseException | None]:
    """(value, None) or (None, error) of a completed future, ours or any torch.futures.Future."""
    try:
        return done.value(), None
    except BaseException as exc:
        return None, exc

To = str | int | WorkerInfo


class RpcAgent:
    """One worker's end of the RPC group (see `shoal.rpc` for the user-facing functions)."""

    def __init__(self, info: WorkerInfo, workers: list[WorkerInfo], transport: Transport, store: Any,
                 options: RpcBackendOptions) -> None:
        self.info, self.rank, self.name = info, info.id, info.name
        self._workers = workers
        self._by_name = {w.name: w for w in workers}
        self.transport, self.store, self.options = transport, store, options
        self.default_timeout = options.rpc_timeout
        self._ids = itertools.count()
        self._gone: set[int] = set()
        self._outstanding = Outstanding(self.name, lambda rank: self._workers[rank].name)
        self._pool = WorkerPool(options.num_worker_threads, f"shoal-rpc-{self.name}")
        self._wire = Wire(transport, timedelta(seconds=options.rpc_timeout), self.name)
        self._riders = Riders(self._send_riders, f"shoal-rpc-notices-{self.name}")
        self.rrefs = OwnerTable()
        self._forks = Forks(self.rank, self.rrefs, self.new_id, self._tell_owner,
                            lambda owner, rref_id, fork_id, entry: RRef._make(self, owner, rref_id, fork_id, entry),
                            self.name)
        self._wire.handle(Kind.REQUEST, self._on_request)
        self._wire.handle(Kind.RESPONSE, self._on_response)
        self._wire.handle(Kind.CONTROL, lambda src, msg_id, change, body, tensors: self._forks.on_change(change))
        self._wire.handle(Kind.NOTICE, self._on_notice)
        transport.on_peer_failure(self._on_peer_failure)

    @classmethod
    def start(cls, name: str, rank: int | None, world_size: int | None, options: RpcBackendOptions) -> RpcAgent:
        """Rendezvous, connect to every other worker, and return once all of them are ready."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"init_rpc: the worker name must be a non-empty string, got {name!r}")
        timeout = timedelta(seconds=options.init_timeout)
        endpoint = rendezvous.resolve(options.init_method, rank, world_size)
        rank, world_size = endpoint.rank, endpoint.world_size
        # A namespace of its own: a process group may share this store (and its server).
        store = rendezvous.join(endpoint, timeout, namespace="shoal-rpc/")
        transport, entries = listen(store, rank, world_size, toward=endpoint.host, timeout=timeout,
                                         stall_timeout=timedelta(seconds=options.rpc_timeout), card=(name,))
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
            agent = cls(workers[rank], workers, transport, store, options)
            hook = autograd_hook.installed()
            if hook is not None:
                hook.started(rank)
            current.set_current(agent)  # calls may arrive as soon as we connect, before init_rpc returns
            connect(transport, entries, timeout)
            # Nobody sends before every agent listens for RPC frames.
            store.set(f"ready/{rank}", 1)
            store.wait([f"ready/{r}" for r in range(world_size)], timeout=timeout)
        except BaseException:
            current.set_current(None)
            if agent is not None:
                agent._tear_down(None)  # its threads too, not only the transport
            else:
                transport.close()
            raise
        return agent

    # ---- names and ids -----------------------------------------------------------------------

    def worker(self, to: To) -> WorkerInfo:
        """The worker `to` names: a name, a rank or a WorkerInfo."""
        if isinstance(to, WorkerInfo):
            if 0 <= to.id < len(self._workers) and self._workers[to.id] == to:
                return to
            raise ValueError(f"{to} is not a worker of this RPC group ({self._workers})")
        if isinstance(to, str):
            if to not in self._by_name:
                raise ValueError(f"no worker is named {to!r}; the workers are {sorted(self._by_name)}")
            return self._by_name[to]
        if isinstance(to, int) and not isinstance(to, bool):
            if not 0 <= to < len(self._workers):
                raise ValueError(f"no worker has rank {to}; ranks are 0..{len(self._workers) - 1}")
            return self._workers[to]
        raise TypeError(f"a worker is named by its name, rank or WorkerInfo, not {type(to).__name__}")

    def is_lost(self, to: To) -> bool:
        """Whether worker `to` has crashed or left: calls to it fail at once with PeerFailure."""
        return self.worker(to).id in self._gone

    def new_id(self) -> tuple[int, int]:
        """An id no other worker can draw: (our rank, a number)."""
        return (self.rank, next(self._ids))

    def timeout_seconds(self, timeout: Timeout) -> float:
        return timeout_seconds(timeout, self.default_timeout)

    # ---- making calls ------------------------------------------------------------------------

    def call(self, to: To, func: Any, args: tuple, kwargs: dict | None, timeout: Timeout) -> Future:
        dst, ref = self.worker(to).id, function_ref(func)
        return self._request(dst, Mode.CALL, args, kwargs, timeout, f"{ref[0]}.{ref[1]}", function=ref)

    def remote(self, to: To, func: Any, args: tuple, kwargs: dict | None, timeout: Timeout) -> RRef:
        dst, ref = self.worker(to).id, function_ref(func)
        if dst == self.rank:  # we are the owner: held by the local RRef alone, until it is forked
            entry = Owned(self.new_id())
            entry.created = True
            created: Future[None] = Future(run_callback=self._run_callback)
            tag = autograd_hook.outgoing_tag(dst, None, autograd_hook.current_context())  # no message: only the context
            self._run_callback(lambda: self._create(entry, ref, args, kwargs or {}, tag, created))
            return RRef._make(self, self.rank, entry.rref_id, None, entry, created)
        rref_id, fork_id = self.new_id(), self.new_id()
        created = self._request(dst, Mode.REMOTE, args, kwargs, timeout, f"remote {ref[1]}", function=ref,
                                rref_id=rref_id, fork_id=fork_id)
        return RRef._make(self, dst, rref_id, fork_id, None, created)

    def notify(self, to: To, func: Any, args: tuple) -> None:
        """Run `func(*args)` on worker `to` without waiting for it or hearing how it went (errors are
        logged there): for bookkeeping that must not cost a round trip. PeerFailure if `to` is
        known to be gone; nothing tells whether it ran if `to` dies or leaves meanwhile."""
        dst, ref = self.worker(to).id, function_ref(func)
        payload = self._forks.encode_for(dst, (args, {}))
        header = Request(Mode.CALL, ref, on_reader=is_run_on_reader(func), riders=self._riders.take(dst))
        self._wire.send(dst, Kind.NOTICE, next(self._ids), header, payload)

    def notify_soon(self, to: To, func: Any, args: tuple) -> None:
        """`notify`, later: the notice rides on the next request or notice this worker sends to `to`,
        or goes alone after a few milliseconds (riders.py). Returns at once. No order is promised,
        among these notices or with other messages; `args` must be plain data (no tensors, no RRefs)."""
        self._riders.add(self.worker(to).id, (function_ref(func), is_run_on_reader(func), args))

    def _send_riders(self, dst: int, riders: tuple[Rider, ...]) -> None:
        """A notice of no function of its own, carrying `riders` (which found no message to ride on)."""
        self._wire.send(dst, Kind.NOTICE, next(self._ids), Request(Mode.CALL, riders=riders), Encoded(b""))

    def fetch(self, rref: RRef, timeout: Timeout) -> Future:
        """A copy of a referenced object from its owner (`RRef.to_here`)."""
        return self._request(rref._owner, Mode.FETCH, (), None, timeout, "RRef.to_here", rref_id=rref._rref_id)

    def _request(self, dst: int, mode: Mode, args: tuple, kwargs: dict | None, timeout: Timeout, what: str, *,
                 function: FunctionRef | None = None, rref_id: RRefId | None = None,
                 fork_id: ForkId | None = None) -> Future:
        seconds = self.timeout_seconds(timeout)
        future: Future = Future(run_callback=self._run_callback)
        # Arguments are pickled apart from the header, so a callee that cannot rebuild them still
        # knows which call (and which remote object) to report the failure for.
        payload = self._forks.encode_for(dst, (tuple(args), kwargs or {}))
        header = Request(mode, function, rref_id, fork_id,
                         autograd_hook.outgoing_tag(dst, payload, autograd_hook.current_context()),
                         riders=self._riders.take(dst))
        msg_id = next(self._ids)
        started = events.begin()
        if started is not None:
            future.add_done_callback(lambda _: events.complete(f"rpc {what}", events.RPC, started, dst=dst))
        self._outstanding.add(msg_id, Call(future, dst, what, seconds))
        try:
            self._wire.send(dst, Kind.REQUEST, msg_id, header, payload)
        except PeerFailure as exc:  # the callee is known dead or gone: fail fast
            self.rrefs.drop_holder(dst)  # forks made for this message went nowhere
            failure = PeerFailure(dst, f"worker {self._workers[dst].name!r}: {exc.detail}")
            self._outstanding.finish(msg_id, None, failure)
        except Exception as exc:
            self._outstanding.finish(msg_id, None, exc)
        return future

    def _run_callback(self, callback: Any) -> None:
        self._outstanding.work_started()
        self._submit(self._run_counted, callback)

    def _run_counted(self, callback: Any) -> None:
        try:
            callback()
        finally:
            self._outstanding.work_done()

    def _submit(self, fn: Any, *args: Any) -> None:
        try:
            self._pool.submit(fn, *args)
        except RuntimeError:  # the pool is shut down: nothing else will run it
            fn(*args)

    def _tell_owner(self, owner: int, change: ForkChange) -> None:
        self._wire.send(owner, Kind.CONTROL, next(self._ids), change, Encoded(b""))

    def release(self, owner: int, rref_id: Any, fork_id: Any) -> None:
        """A user RRef is gone (called from its __del__)."""
        self._forks.release(owner, rref_id, fork_id)

    # ---- serving calls -----------------------------------------------------------------------

    def _on_request(self, src: int, msg_id: int, header: Request, body: bytes | bytearray,
                    tensors: list[torch.Tensor]) -> None:
        # Runs on the reader thread, in arrival order: RRef forks in the arguments and the entry of
        # a remote() call are registered before any later message from the same worker is seen.
        mode, tag = header.mode, header.autograd
        try:
            entry = self.rrefs.created_remotely(header.rref_id, header.fork_id, src) if mode is Mode.REMOTE else None
            try:
                grad_tensors: dict[int, torch.Tensor] = {}
                args, kwargs = decode(body, tensors, self._forks.adopt, grad_tensors)
                autograd_hook.record_arrival(src, tag, grad_tensors)
            except Exception as exc:
                if entry is not None:
                    entry.value.set_exception(exc)
                self._submit(self._reply, src, msg_id, None, exc, None)
                return
            if mode is Mode.CALL:
                self._submit(self._run_function, header.function, args, kwargs, tag,
                             lambda value, error: self._reply(src, msg_id, value, error, tag))
            elif mode is Mode.REMOTE:
                self._submit(self._serve_remote, src, msg_id, header.function, args, kwargs, entry, tag)
            elif mode is Mode.FETCH:
                owned = self.rrefs.entry(header.rref_id)
                owned.value.add_done_callback(
                    lambda done: self._on_a_pool_thread(self._reply, src, msg_id, *_outcome(done), tag))
        finally:  # whatever became of the request
            if header.riders:
                self._run_riders(src, header.riders)

    def _on_notice(self, src: int, msg_id: int, header: Request, body: bytes | bytearray,
                   tensors: list[torch.Tensor]) -> None:
        if header.function is not None:
            try:
                args, kwargs = decode(body, tensors, self._forks.adopt)
            except Exception as exc:
                log.error("worker %r: notice %s.%s from rank %d could not be read: %r", self.name, *header.function,
                          src, exc)
            else:
                self._run_notice(src, header.function, header.on_reader, args, kwargs)
        self._run_riders(src, header.riders)

    def _run_riders(self, src: int, riders: tuple[Rider, ...]) -> None:
        """Run the notices that came along with a message, after the message itself is under way:
        nobody waits for them, and they promise no order."""
        for function, on_reader, args in riders:
            self._run_notice(src, function, on_reader, args, {})

    def _run_notice(self, src: int, ref: FunctionRef, on_reader: bool, args: tuple, kwargs: dict) -> None:
        def settle(value: Any, error: BaseException | None) -> None:
            if error is not None:  # nobody waits for an answer: this log is all that is left of it
                log.error("worker %r: notice %s.%s from rank %d failed: %r", self.name, *ref, src, error)

        if on_reader:  # marked by the sender: one of shoal's own quick functions, imported everywhere
            self._run_function(ref, args, kwargs, None, settle)
        else:
            self._submit(self._run_function, ref, args, kwargs, None, settle)

    def _run_function(self, ref: FunctionRef, args: tuple, kwargs: dict, tag: AutogradTag | None,
                      settle: Callable[[Any, BaseException | None], None]) -> None:
        """Run a requested function in its caller's autograd context; `settle(value, error)` gets
        the outcome at once or, for an @async_execution function, once its future completes."""
        try:
            func = resolve_function(ref, self.name)
            started = events.begin()
            try:
                if tag is None:  # most calls: no context to enter (and a `with` would cost calls)
                    result = func(*args, **kwargs)
                else:
                    with autograd_hook.serving(tag):
                        result = func(*args, **kwargs)
            finally:
                if started is not None:
                    events.complete(f"serve {ref[0]}.{ref[1]}", events.COMPUTE, started)
            answers_later = is_async_execution(func)
            if answers_later and not isinstance(result, torch._C.Future):  # then()'s futures are only that
                raise TypeError(f"{ref[0]}.{ref[1]} is an @async_execution function, so it must return a future, "
                                f"not {type(result).__name__}")
        except BaseException as exc:  # SystemExit too: the caller must hear of it, not time out
            settle(None, exc)
            return
        if answers_later:
            result.add_done_callback(lambda done: self._on_a_pool_thread(settle, *_outcome(done)))
        else:
            settle(result, None)

    def _on_a_pool_thread(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn` here if this is one of our pool's threads, else hand it to the pool: a future may
        complete on any thread, a connection's reader included, where nothing may block."""
        if self._pool.on_own_thread():
            fn(*args)
        else:
            self._submit(fn, *args)

    def _serve_remote(self, src: int, msg_id: int, ref: FunctionRef, args: tuple, kwargs: dict, entry: Owned,
                      tag: AutogradTag | None) -> None:
        created: Future[None] = Future(run_callback=self._run_callback)
        self._create(entry, ref, args, kwargs, tag, created)
        created.add_done_callback(lambda done: self._reply(src, msg_id, None, done.exception(), tag))

    def _create(self, entry: Owned, ref: FunctionRef, args: tuple, kwargs: dict, tag: AutogradTag | None,
                created: Future[None]) -> None:
        """Compute the object of a remote() call into its entry; `created` reports how that went."""
        def settle(value: Any, error: BaseException | None) -> None:
            entry.value._complete(value, error)
            created._complete(None, error)

        self._run_function(ref, args, kwargs, tag, settle)

    def _reply(self, dst: int, msg_id: int, value: Any, error: BaseException | None, tag: AutogradTag | None) -> None:
        """Answer a request; tensors in the answer that require grad are a send of the request's context."""
        answer_tag = None
        if error is None:
            try:
                payload = self._forks.encode_for(dst, value)
            except Exception as exc:
                error = TypeError(f"the result ({type(value).__name__}) could not be sent back: {exc}")
            else:
                try:
                    answer_tag = autograd_hook.outgoing_tag(dst, payload, tag.context_id if tag is not None else None)
                except Exception as exc:  # its context ended meanwhile
                    error = exc
        if error is not None:
            payload = encode(pack_error(error, self.name))
        try:
            self._wire.send(dst, Kind.RESPONSE, msg_id, Response(ok=error is None, autograd=answer_tag), payload)
        except PeerFailure as exc:
            self.rrefs.drop_holder(dst)  # the caller is gone, with every fork it held
            log.debug("worker %r: the answer to rank %d was lost: %s", self.name, dst, exc)
        except (GroupBrokenError, TimeoutError) as exc:
            # Shutting down, or the answer is still queued: the caller lives, and so do its forks.
            log.debug("worker %r: the answer to rank %d did not leave in time: %s", self.name, dst, exc)

    def _on_response(self, src: int, msg_id: int, header: Response, body: bytes | bytearray,
                     tensors: list[torch.Tensor]) -> None:
        # Decoded even when the call has timed out meanwhile: RRefs in it must be adopted (and then
        # released), or their owner would keep the objects forever.
        call = self._outstanding.get(msg_id)
        answered = call is not None and call.dst == src  # else late: its context may be gone
        try:
            grad_tensors: dict[int, torch.Tensor] = {}
            payload = decode(body, tensors, self._forks.adopt, grad_tensors)
            if answered:
                autograd_hook.record_arrival(src, header.autograd, grad_tensors)
            value, error = (payload, None) if header.ok else (None, unpack_error(payload))
        except Exception as exc:
            value, error = None, RuntimeError(f"the answer from worker {self._workers[src].name!r} could not "
                                              f"be rebuilt: {exc}")
        if answered:
            self._outstanding.finish(msg_id, value, error)

    # ---- failures and shutdown ---------------------------------------------------------------

    def _on_peer_failure(self, error: PeerFailure) -> None:
        rank = error.rank
        self._gone.add(rank)
        self._wire.forget(rank)
        self._riders.drop(rank)
        self._outstanding.fail_calls_to(rank, PeerFailure(rank, f"worker {self._workers[rank].name!r}: {error.detail}"))
        self.rrefs.drop_holder(rank)
        hook = autograd_hook.installed()
        if hook is not None:
            hook.peer_failed(rank)

    def shutdown(self, graceful: bool, timeout: float | None) -> None:
        """Graceful: wait for our calls, tell the others we are done, and keep serving theirs until
        every worker is done too; then tear down. Otherwise tear down at once."""
        everyone_done = False
        deadline = time.monotonic() + (timeout or self.options.shutdown_timeout)
        try:
            if graceful:
                self._outstanding.wait_idle(deadline)
                self._riders.flush(max(0.0, deadline - time.monotonic()))  # before we say we are done
                self._forks.flush(max(0.0, deadline - time.monotonic()))
                self._wait_for_everyone(deadline)
                everyone_done = True
        finally:
            # Past a deadline, calls may still be running here: the timeout bounds shutdown, so they
            # are left to finish on their own, or to end with the process (the pool's threads are
            # daemons: a call that never returns must not keep the interpreter from exiting).
            self._tear_down(deadline if everyone_done else None)

    def _wait_for_everyone(self, deadline: float) -> None:
        self.store.set(f"done/{self.rank}", 1)
        self._wait_for_keys("done", deadline, "finish its RPCs")
        # Rank 0 serves the store when no launcher does: it leaves last, once nobody needs to read from it.
        self.store.set(f"left/{self.rank}", 1)
        if self.rank == 0:
            self._wait_for_keys("left", deadline, "leave")

    def _wait_for_keys(self, name: str, deadline: float, what: str) -> None:
        # Polled: a worker that dies meanwhile (it joins _gone) must not be waited for. With
        # backoff: a server may wait here for its trainers' whole run, and every poll is a request
        # to the store.
        for rank in range(len(self._workers)):
            for _ in attempts(deadline, first=0.005, limit=0.1, factor=1.5):
                if rank in self._gone or self.store.has(f"{name}/{rank}"):
                    break
            else:
                raise TimeoutError(f"worker {self.name!r}: worker {self._workers[rank].name!r} did not "
                                   f"{what} before the shutdown deadline")

    def _tear_down(self, deadline: float | None) -> None:
        """Close everything; with a deadline, also wait until then for calls still being served."""
        self._outstanding.close()
        self._riders.stop(timeout=5.0)
        self._forks.stop(timeout=5.0)
        self.transport.close(timedelta(seconds=5))
        # Not cancelled: callbacks of the futures failed above are queued there, and a future's
        # callback must run (calls from others that are queued fail fast on the closed transport).
        self._pool.shutdown()
        hook = autograd_hook.installed()
        if hook is not None:
            hook.stopped(deadline)
        if deadline is not None:
            # A call whose caller gave up may still run here; the deadline bounds shutdown all the same.
            self._pool.join(deadline)
