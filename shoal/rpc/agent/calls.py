"""The calling side of the agent: this worker's requests to others (calls, remote() calls, fetches of
referenced objects), and the answers that complete their futures."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from shoal.errors import PeerFailure
from shoal.observe import events
from shoal.rpc import autograd_contexts
from shoal.rpc.agent.notices import Notices
from shoal.rpc.agent.outstanding import Call, Outstanding
from shoal.rpc.agent.running import Runner
from shoal.rpc.agent.wire import Wire
from shoal.rpc.autograd_contexts import contexts
from shoal.rpc.future import Future
from shoal.rpc.headers import ForkId, FunctionRef, Kind, Mode, Request, Response, RRefId
from shoal.rpc.message import decode, function_ref, unpack_error
from shoal.rpc.options import Timeout, timeout_seconds
from shoal.rpc.rref_context import Reference, RRefContext

if TYPE_CHECKING:
    from shoal.rpc.rref import RRef


class Caller:
    """Sends this worker's requests, each by rank, and completes their futures: with the answer, or
    with the failure `outstanding` sees first. `ids` numbers the messages this worker sends, and
    `new_id()` draws the ids of the objects its remote() calls create."""

    def __init__(self, rank: int, default_timeout: float, worker_name: Callable[[int], str], *, wire: Wire,
                 ids: Iterator[int], new_id: Callable[[], tuple[int, int]], rrefs: RRefContext,
                 outstanding: Outstanding, runner: Runner, notices: Notices) -> None:
        self._rank = rank
        self._default_timeout = default_timeout
        self._worker_name = worker_name
        self._wire = wire
        self._ids = ids
        self._new_id = new_id
        self._rrefs = rrefs
        self._outstanding = outstanding
        self._runner = runner
        self._notices = notices

    def call(self, dst: int, func: Any, args: tuple, kwargs: dict | None, timeout: Timeout) -> Future:
        ref = function_ref(func)
        return self._request(dst, Mode.CALL, args, kwargs, timeout, f"{ref[0]}.{ref[1]}", function=ref)

    def remote(self, dst: int, func: Any, args: tuple, kwargs: dict | None, timeout: Timeout) -> RRef:
        ref = function_ref(func)
        runner = self._runner
        if dst == self._rank:  # we are the owner: held by the local RRef alone, until it is forked
            reference = self._rrefs.own_later()
            created: Future[None] = Future(run_callback=runner.run_callback)
            tag = autograd_contexts.outgoing_tag(dst, None, contexts.current_context())  # no message: only the context
            runner.run_callback(lambda: runner.create(reference.entry, ref, args, kwargs or {}, tag, created))
            return self._rrefs.make(reference, created)
        rref_id, fork_id = self._new_id(), self._new_id()
        created = self._request(dst, Mode.REMOTE, args, kwargs, timeout, f"remote {ref[1]}", function=ref,
                                rref_id=rref_id, fork_id=fork_id)
        return self._rrefs.make(Reference(dst, rref_id, fork_id), created)

    def fetch(self, owner: int, rref_id: RRefId, timeout: Timeout) -> Future:
        """A copy of a referenced object from its owner (`RRef.to_here`)."""
        return self._request(owner, Mode.FETCH, (), None, timeout, "RRef.to_here", rref_id=rref_id)

    def _request(self, dst: int, mode: Mode, args: tuple, kwargs: dict | None, timeout: Timeout, what: str, *,
                 function: FunctionRef | None = None, rref_id: RRefId | None = None,
                 fork_id: ForkId | None = None) -> Future:
        seconds = timeout_seconds(timeout, self._default_timeout)
        future: Future = Future(run_callback=self._runner.run_callback)
        # Arguments are pickled apart from the header, so a callee that cannot rebuild them still
        # knows which call (and which remote object) to report the failure for.
        payload = self._rrefs.encode_for(dst, (tuple(args), kwargs or {}))
        header = Request(mode, function, rref_id, fork_id,
                         autograd_contexts.outgoing_tag(dst, payload, contexts.current_context()),
                         riders=self._notices.take(dst))
        msg_id = next(self._ids)
        started = events.begin()
        if started is not None:
            future.add_done_callback(lambda _: events.complete(f"rpc {what}", events.RPC, started, dst=dst))
        self._outstanding.add(msg_id, Call(future, dst, what, seconds))
        try:
            self._wire.send(dst, Kind.REQUEST, msg_id, header, payload)
        except PeerFailure as exc:  # the callee is known dead or gone: fail fast
            self._rrefs.table.drop_holder(dst)  # forks made for this message went nowhere
            failure = PeerFailure(dst, f"worker {self._worker_name(dst)!r}: {exc.detail}")
            self._outstanding.finish(msg_id, None, failure)
        except Exception as exc:
            self._outstanding.finish(msg_id, None, exc)
        return future

    def on_response(self, src: int, msg_id: int, header: Response, body: bytes | bytearray,
                    tensors: list[torch.Tensor]) -> None:
        # Decoded even when the call has timed out meanwhile: RRefs in it must be adopted (and then
        # released), or their owner would keep the objects forever.
        call = self._outstanding.get(msg_id)
        answered = call is not None and call.dst == src  # else late: its context may be gone
        try:
            grad_tensors: dict[int, torch.Tensor] = {}
            payload = decode(body, tensors, self._rrefs.adopt, grad_tensors)
            if answered:
                autograd_contexts.record_arrival(src, header.autograd, grad_tensors)
            value, error = (payload, None) if header.ok else (None, unpack_error(payload))
        except Exception as exc:
            value, error = None, RuntimeError(f"the answer from worker {self._worker_name(src)!r} could not "
                                              f"be rebuilt: {exc}")
        if answered:
            self._outstanding.finish(msg_id, value, error)
