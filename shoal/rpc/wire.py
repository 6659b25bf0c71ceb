"""RPC messages over the transport: each tensor as a frame of its own, then the body (typed header
and payload) that completes the message; on arrival, tensor frames become tensors (fresh ones, or
views of the shared-memory slot they came in), wait for their body, and the whole message goes to
the handler registered for its kind."""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from shoal.comm.frames import Op, Payload, SendTracker
from shoal.comm.ring import as_bytes
from shoal.comm.transport import Transport
from shoal.rpc.headers import Kind
from shoal.rpc.message import Encoded

log = logging.getLogger(__name__)

# The transport group whose frames are RPC messages; process groups number theirs up from 0.
RPC_GROUP = 0xFFFF_FF00
_SIGNATURE = (0, 0, 0, 0, 0)  # RPC frames are matched by message id, not by a collective's signature

# handler(src, message id, header, payload body, tensors)
Handler = Callable[[int, int, Any, bytes | bytearray, list[torch.Tensor]], None]


def _tag(kind: Kind, tensor_count: int) -> int:
    """The frame tag: message kind and how many tensor frames precede the body."""
    return kind << 32 | tensor_count


class Wire:
    """Sends and receives whole RPC messages between this worker and the others (itself included)."""

    def __init__(self, transport: Transport, stall_timeout: timedelta, name: str) -> None:
        self.transport = transport
        self.rank = transport.rank
        self._name = name
        self._stall_timeout = stall_timeout
        self._handlers: dict[Kind, Handler] = {}
        self._partial: dict[tuple[int, int, int], list[torch.Tensor]] = {}  # tensor frames before their body
        transport.serve(RPC_GROUP, self._on_frame)

    def handle(self, kind: Kind, handler: Handler) -> None:
        """Route messages of `kind` to `handler`; it runs on the connection's reader thread, in
        arrival order, so it must hand anything slow or blocking to a thread of its own."""
        self._handlers[kind] = handler

    def send(self, dst: int, kind: Kind, msg_id: int, header: Any, payload: Encoded) -> None:
        """Queue a message for `dst` (PeerFailure if it is known to be gone); frames of one message
        leave in order, so its body arrives after its tensors."""
        if dst == self.rank:  # a message to ourselves: same path, minus the sockets
            self._dispatch(self.rank, kind, msg_id, header, payload.body, [t.clone() for t in payload.tensors])
            return
        body = pickle.dumps((header, payload.body), protocol=pickle.HIGHEST_PROTOCOL)
        op = Op(RPC_GROUP, _tag(kind, len(payload.tensors)), msg_id, _SIGNATURE, (dst,), self._stall_timeout,
                "rpc", lambda sig: "an RPC message")
        tracker = SendTracker()
        # Acknowledgements are cumulative: the body's covers the tensor frames before it. Only a message
        # with tensors is waited on below; the rest are acknowledged by what comes back.
        for sub, tensor in enumerate(payload.tensors, start=1):
            self.transport.send(op, dst, sub, as_bytes(tensor), tracker, eager=True, acknowledge=False)
        self.transport.send(op, dst, 0, memoryview(body), tracker, eager=True, acknowledge=bool(payload.tensors))
        if payload.tensors:
            # Tensor frames are sent from the tensors' own memory: return only once the peer has them,
            # so that a caller (or a callee whose result is a live parameter) may change them in place
            # at once (and a replay after a dropped connection still sends what was sent).
            tracker.wait(time.monotonic() + self._stall_timeout.total_seconds(), f"RPC message {msg_id}")

    def forget(self, rank: int) -> None:
        """Drop the parts of messages a failed worker never finished."""
        # list() copies the keys in one step: readers of other peers add and remove meanwhile.
        for key in [key for key in list(self._partial) if key[0] == rank]:
            self._partial.pop(key, None)

    def _on_frame(self, src: int, tag: int, seq: int, sub: int, nbytes: int, payload: Payload) -> None:
        kind, tensor_count = tag >> 32, tag & 0xFFFF_FFFF
        key = (src, kind, seq)
        if sub:
            # A tensor in a shared-memory slot is used where it lies: one copy per hop, not two.
            tensor = payload.lend() if payload.lend is not None else None
            if tensor is None:
                tensor = torch.empty(nbytes, dtype=torch.uint8)
                payload.fill(as_bytes(tensor))
            self._partial.setdefault(key, []).append(tensor)
            return
        body = bytearray(nbytes)
        payload.fill(memoryview(body))
        tensors = self._partial.pop(key, []) if tensor_count else []
        if len(tensors) != tensor_count:
            raise ConnectionError(f"RPC message {seq} from rank {src} came with {len(tensors)} of its "
                                  f"{tensor_count} tensors")
        try:
            kind, (header, inner) = Kind(kind), pickle.loads(body)
        except Exception:  # one bad message must not take the connection down with it
            log.exception("worker %r: RPC message %d from rank %d has no readable header", self._name, seq, src)
            return
        self._dispatch(src, kind, seq, header, inner, tensors)

    def _dispatch(self, src: int, kind: Kind, msg_id: int, header: Any, body: bytes | bytearray,
                  tensors: list[torch.Tensor]) -> None:
        try:
            self._handlers[kind](src, msg_id, header, body, tensors)
        except Exception:  # one bad message must not take the connection down with it
            log.exception("worker %r: RPC %s %d from rank %d could not be handled", self._name, kind.name,
                          msg_id, src)
