"""RPC messages over the transport: each tensor as a frame of its own, then the body that completes
the message; on arrival, tensor frames become tensors (fresh ones, or views of the shared-memory slot
they came in) and wait for their body."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch

from shoal.comm.frames import Op, Payload, SendTracker
from shoal.comm.ring import as_bytes
from shoal.comm.transport import Transport
from shoal.rpc.message import Encoded, split_tag, tag_of

# The transport group whose frames are RPC messages; process groups number theirs up from 0.
RPC_GROUP = 0xFFFF_FF00
_SIGNATURE = (0, 0, 0, 0, 0)  # RPC frames are matched by message id, not by a collective's signature

# on_message(src, kind, message id, body, tensors)
MessageHandler = Callable[[int, int, int, bytes | bytearray, list[torch.Tensor]], None]


class Wire:
    """Sends and receives whole RPC messages between this worker and the others (itself included)."""

    def __init__(self, transport: Transport, on_message: MessageHandler, stall_timeout: timedelta) -> None:
        self.transport = transport
        self.rank = transport.rank
        self._on_message = on_message
        self._stall_timeout = stall_timeout
        self._partial: dict[tuple[int, int, int], list[torch.Tensor]] = {}  # tensor frames before their body
        transport.serve(RPC_GROUP, self._on_frame)

    def send(self, dst: int, kind: int, msg_id: int, message: Encoded) -> None:
        """Queue `message` for `dst` (PeerFailure if it is known to be gone); frames of one message
        leave in order, so its body arrives after its tensors."""
        if dst == self.rank:  # a message to ourselves: same path, minus the sockets
            self._on_message(self.rank, kind, msg_id, message.body, [t.clone() for t in message.tensors])
            return
        op = Op(RPC_GROUP, tag_of(kind, len(message.tensors)), msg_id, _SIGNATURE, (dst,), self._stall_timeout,
                "rpc", lambda sig: "an RPC message")
        tracker = SendTracker()
        for sub, tensor in enumerate(message.tensors, start=1):
            self.transport.send(op, dst, sub, as_bytes(tensor), tracker, eager=True)
        self.transport.send(op, dst, 0, memoryview(message.body), tracker, eager=True)
        if message.tensors:
            # Tensor frames are sent from the tensors' own memory: return only once it has been
            # read, so that a caller (or a callee whose result is a live parameter) may change
            # them in place at once. Usually written already, by this thread (eager).
            tracker.wait(time.monotonic() + self._stall_timeout.total_seconds(), f"RPC message {msg_id}")

    def forget(self, rank: int) -> None:
        """Drop the parts of messages a failed worker never finished."""
        # list() copies the keys in one step: readers of other peers add and remove meanwhile.
        for key in [key for key in list(self._partial) if key[0] == rank]:
            self._partial.pop(key, None)

    def _on_frame(self, src: int, tag: int, seq: int, sub: int, nbytes: int, payload: Payload) -> None:
        kind, tensor_count = split_tag(tag)
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
        self._on_message(src, kind, seq, body, tensors)
