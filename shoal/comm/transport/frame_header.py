"""The fixed-size header in front of every frame between two ranks, and the socket I/O of whole frames."""

from __future__ import annotations

import enum
import socket
import struct
from typing import NamedTuple

NO_SLOT = -1  # the payload follows the header on the socket, not in a shared-memory slot
# Flag: the sender waits for this frame's acknowledgement, so the receiver sends one at once rather than
# leaving it to the next frame or heartbeat going back (each extra frame costs a wake-up on both sides).
ACK_NOW = 1


class Kind(enum.IntEnum):
    DATA = 1  # a payload for a posted receive or a served group
    ABORT = 2  # an operation failed on the sender: its text says why
    BYE = 3  # the sender closes the connection after this frame
    SHM_OFFER = 4  # the name of the sender's shared-memory region towards us
    SHM_ACCEPT = 5  # we mapped the region the peer offered
    ACK = 6  # unnumbered: only the acknowledgement every header carries
    HEARTBEAT = 7  # unnumbered: the sender is alive and has nothing else to say


class FrameHeader(NamedTuple):
    kind: Kind
    nbytes: int = 0  # payload length
    group: int = 0  # (group, tag, seq): the operation the frame belongs to
    tag: int = 0
    seq: int = 0
    sub: int = 0  # which frame of the operation
    opcode: int = 0  # (opcode, dtype, redop, root, numel): what the sender's operation is
    dtype: int = 0
    redop: int = 0
    root: int = 0
    numel: int = 0
    slot: int = NO_SLOT  # the shared-memory slot holding the payload
    number: int = 0  # the frame's place in the link's stream (from 1; 0 for ACK and HEARTBEAT)
    ack: int = 0  # the last frame number the sender has received from us
    flags: int = 0  # ACK_NOW

    @property
    def ident(self) -> tuple[int, int, int]:
        return (self.group, self.tag, self.seq)

    @property
    def signature(self) -> tuple[int, int, int, int, int]:
        return (self.opcode, self.dtype, self.redop, self.root, self.numel)

    def pack(self, number: int, ack: int) -> bytes:
        """The header as it goes out: a link numbers its frames, and each carries its latest
        acknowledgement, only when written."""
        return _LAYOUT.pack(*self[:_NUMBER], number, ack, self.flags)

    @classmethod
    def unpack(cls, data: bytes | bytearray) -> FrameHeader:
        kind, *rest = _LAYOUT.unpack(data)
        try:
            return cls(_KINDS[kind], *rest)
        except KeyError:
            raise ValueError(f"no frame kind {kind}") from None


_LAYOUT = struct.Struct("<BQIqQIBBBiQiQQB")  # in FrameHeader's field order
SIZE = _LAYOUT.size
_NUMBER = FrameHeader._fields.index("number")
_KINDS = {kind.value: kind for kind in Kind}


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        got = sock.recv_into(view, len(view), socket.MSG_WAITALL)
        if got == 0:
            raise ConnectionResetError("connection closed by peer")
        view = view[got:]


def send_frame(sock: socket.socket, header: bytes, payload: memoryview) -> None:
    sent = sock.sendmsg([header, payload])
    while sent < len(header):
        sent += sock.sendmsg([header[sent:], payload])
    if sent - len(header) < len(payload):
        sock.sendall(payload[sent - len(header):])
