"""RPC messages over the transport. A message whose tensors are small travels as one frame: the
body (typed header and payload) with copies of the tensors' bytes behind it. Otherwise each tensor
goes as a frame of its own, sent from its own memory, then the body that completes the message. On
arrival, tensors become views of the frame they came in (the body's, a fresh buffer, or the
shared-memory slot), and the whole message goes to the handler registered for its kind."""

from __future__ import annotations

import logging
import pickle
import struct
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from shoal.comm.transport import Payload, SendTracker, Transport, as_bytes
from shoal.rpc.headers import Kind
from shoal.rpc.message import Encoded

log = logging.getLogger(__name__)

# The transport group whose frames are RPC messages; process groups number theirs up from 0.
RPC_GROUP = 0xFFFF_FF00

# Tensors of at most this many bytes in all travel copied inside their message's one frame. The
# copy costs microseconds; a frame per tensor costs a write and a read each, and the sender of a
# tensor over the transport's COPY_BYTES, sent from its own memory, must wait until the peer has it
# (a round trip).
INLINE_BYTES = 256 * 1024
_INLINE = 1 << 31  # in a frame tag: the body carries its tensors
_ALIGN = 16  # where each carried tensor starts in the frame: any dtype may view it
_HEAD_LENGTH = struct.Struct("<Q")
_KINDS = {kind.value: kind for kind in Kind}  # a dict lookup: calling an Enum runs Python code

# handler(src, message id, header, payload body, tensors)
Handler = Callable[[int, int, Any, bytes | bytearray, list[torch.Tensor]], None]


def _tag(kind: Kind, tensor_count: int, inline: bool) -> int:
    """The frame tag: message kind, how many tensors the message has, and whether they are in the body
    (else that many tensor frames precede it)."""
    return kind << 32 | (_INLINE if inline else 0) | tensor_count


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _with_tensors(head: bytes, tensors: list[torch.Tensor]) -> bytes:
    """One frame: the head's length, the head, then each (flat byte) tensor at an aligned offset
    (joined: one copy of each part, where filling a zeroed buffer wrote every byte twice)."""
    parts: list[bytes | memoryview] = [_HEAD_LENGTH.pack(len(head)), head]
    at = _HEAD_LENGTH.size + len(head)
    for tensor in tensors:
        padding = _aligned(at) - at
        parts += [bytes(padding), as_bytes(tensor)]
        at += padding + tensor.numel()
    return b"".join(parts)


def _carried(frame: bytearray) -> tuple[Any, list[torch.Tensor]]:
    """The head of a frame made by _with_tensors, and its tensors as views of the frame."""
    (length,) = _HEAD_LENGTH.unpack_from(frame)
    header, inner, sizes = pickle.loads(memoryview(frame)[_HEAD_LENGTH.size:_HEAD_LENGTH.size + length])
    at, tensors = _aligned(_HEAD_LENGTH.size + length), []
    for size in sizes:
        tensors.append(torch.frombuffer(frame, dtype=torch.uint8, count=size, offset=at) if size
                       else torch.empty(0, dtype=torch.uint8))
        at += _aligned(size)
    return (header, inner), tensors


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
        tensors = payload.tensors
        sizes = [t.numel() for t in tensors]
        inline = sum(sizes) <= INLINE_BYTES
        if inline:
            body = memoryview(_with_tensors(pickle.dumps((header, payload.body, sizes),
                                                         protocol=pickle.HIGHEST_PROTOCOL), tensors))
            tensors = []
        else:
            body = memoryview(pickle.dumps((header, payload.body), protocol=pickle.HIGHEST_PROTOCOL))
        tag = _tag(kind, len(payload.tensors), inline)
        # Acknowledgements are cumulative: the body's covers the tensor frames before it. Only a message
        # with tensor frames is waited on below; the rest are acknowledged by what comes back.
        tracker = SendTracker() if tensors else None
        send = self.transport.send_message
        for sub, tensor in enumerate(tensors, start=1):
            send(dst, RPC_GROUP, tag, msg_id, sub, as_bytes(tensor), tracker, acknowledge=False)
        send(dst, RPC_GROUP, tag, msg_id, 0, body, tracker, acknowledge=bool(tensors))
        if tensors:
            # Return only once the tensors may change: a caller (or a callee whose result is a live
            # parameter) may change them in place at once, and a replay after a dropped connection must
            # still send what was sent. The transport copies a frame up to its COPY_BYTES and settles it
            # once written; a larger one is sent from the tensor's own memory until the peer has it.
            tracker.wait(time.monotonic() + self._stall_timeout.total_seconds(), f"RPC message {msg_id}")

    def forget(self, rank: int) -> None:
        """Drop the parts of messages a failed worker never finished."""
        # list() copies the keys in one step: readers of other peers add and remove meanwhile.
        for key in [key for key in list(self._partial) if key[0] == rank]:
            self._partial.pop(key, None)

    def _on_frame(self, src: int, tag: int, seq: int, sub: int, nbytes: int, payload: Payload) -> None:
        kind, inline, tensor_count = tag >> 32, bool(tag & _INLINE), tag & (_INLINE - 1)
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
        tensors = self._partial.pop(key, []) if tensor_count and not inline else []
        try:
            kind, ((header, inner), tensors) = _KINDS[kind], _carried(body) if inline else (pickle.loads(body), tensors)
        except Exception:  # one bad message must not take the connection down with it
            log.exception("worker %r: RPC message %d from rank %d has no readable header", self._name, seq, src)
            return
        if len(tensors) != tensor_count:
            raise ConnectionError(f"RPC message {seq} from rank {src} came with {len(tensors)} of its "
                                  f"{tensor_count} tensors")
        self._dispatch(src, kind, seq, header, inner, tensors)

    def _dispatch(self, src: int, kind: Kind, msg_id: int, header: Any, body: bytes | bytearray,
                  tensors: list[torch.Tensor]) -> None:
        try:
            self._handlers[kind](src, msg_id, header, body, tensors)
        except Exception:  # one bad message must not take the connection down with it
            log.exception("worker %r: RPC %s %d from rank %d could not be handled", self._name, kind.name,
                          msg_id, src)
