"""The serving side of the agent: requests from other workers (calls, remote() calls, fetches of
owned objects) run on the pool, and their answers go back to the caller."""

from __future__ import annotations

import logging
from typing import Any

import torch

from shoal.errors import GroupBrokenError, PeerFailure
from shoal.rpc import autograd_contexts
from shoal.rpc.agent.notices import Notices
from shoal.rpc.agent.running import Runner, outcome
from shoal.rpc.agent.wire import Wire
from shoal.rpc.future import Future
from shoal.rpc.headers import AutogradTag, FunctionRef, Kind, Mode, Request, Response
from shoal.rpc.message import decode, encode, pack_error
from shoal.rpc.rref_context import Owned, RRefContext

log = logging.getLogger(__name__)


class Server:
    """Answers the requests that reach this worker; the notices riding on them go to `notices`."""

    def __init__(self, name: str, *, wire: Wire, rrefs: RRefContext, runner: Runner, notices: Notices) -> None:
        self._name = name
        self._wire = wire
        self._rrefs = rrefs
        self._runner = runner
        self._notices = notices

    def on_request(self, src: int, msg_id: int, header: Request, body: bytes | bytearray,
                   tensors: list[torch.Tensor]) -> None:
        # Runs on the reader thread, in arrival order: RRef forks in the arguments and the entry of
        # a remote() call are registered before any later message from the same worker is seen.
        mode, tag, runner = header.mode, header.autograd, self._runner
        try:
            entry = (self._rrefs.table.created_remotely(header.rref_id, header.fork_id, src) if mode is Mode.REMOTE
                     else None)
            try:
                grad_tensors: dict[int, torch.Tensor] = {}
                args, kwargs = decode(body, tensors, self._rrefs.adopt, grad_tensors)
                autograd_contexts.record_arrival(src, tag, grad_tensors)
            except Exception as exc:
                if entry is not None:
                    entry.value.set_exception(exc)
                runner.submit(self._reply, src, msg_id, None, exc, None)
                return
            if mode is Mode.CALL:
                runner.submit(runner.run_function, header.function, args, kwargs, tag,
                              lambda value, error: self._reply(src, msg_id, value, error, tag))
            elif mode is Mode.REMOTE:
                runner.submit(self._serve_remote, src, msg_id, header.function, args, kwargs, entry, tag)
            elif mode is Mode.FETCH:
                owned = self._rrefs.table.entry(header.rref_id)
                owned.value.add_done_callback(
                    lambda done: runner.on_a_pool_thread(self._reply, src, msg_id, *outcome(done), tag))
        finally:  # whatever became of the request
            if header.riders:
                self._notices.run_riders(src, header.riders)

    def _serve_remote(self, src: int, msg_id: int, ref: FunctionRef, args: tuple, kwargs: dict, entry: Owned,
                      tag: AutogradTag | None) -> None:
        created: Future[None] = Future(run_callback=self._runner.run_callback)
        self._runner.create(entry, ref, args, kwargs, tag, created)
        created.add_done_callback(lambda done: self._reply(src, msg_id, None, done.exception(), tag))

    def _reply(self, dst: int, msg_id: int, value: Any, error: BaseException | None, tag: AutogradTag | None) -> None:
        """Answer a request; tensors in the answer that require grad are a send of the request's context."""
        answer_tag = None
        if error is None:
            try:
                payload = self._rrefs.encode_for(dst, value)
            except Exception as exc:
                error = TypeError(f"the result ({type(value).__name__}) could not be sent back: {exc}")
            else:
                try:
                    context_id = tag.context_id if tag is not None else None
                    answer_tag = autograd_contexts.outgoing_tag(dst, payload, context_id)
                except Exception as exc:  # its context ended meanwhile
                    error = exc
        if error is not None:
            payload = encode(pack_error(error, self._name))
        try:
            self._wire.send(dst, Kind.RESPONSE, msg_id, Response(ok=error is None, autograd=answer_tag), payload)
        except PeerFailure as exc:
            self._rrefs.table.drop_holder(dst)  # the caller is gone, with every fork it held
            log.debug("worker %r: the answer to rank %d was lost: %s", self._name, dst, exc)
        except (GroupBrokenError, TimeoutError) as exc:
            # Shutting down, or the answer is still queued: the caller lives, and so do its forks.
            log.debug("worker %r: the answer to rank %d did not leave in time: %s", self._name, dst, exc)
