"""A link's receiving half: a reader thread parses frames, drops those it already has (sent again after a
reconnect), acknowledges each one as soon as it is in, and hands it to the link's owner; a payload is read
over as many connections as it takes, or taken from the shared-memory lane it came through."""

from __future__ import annotations

import logging
import socket
import time
from typing import TYPE_CHECKING

import torch

from shoal.comm.shm import lanes
from shoal.comm.transport.delivery import on_reader_thread
from shoal.comm.transport.frame_header import ACK_NOW, NO_SLOT, FrameHeader, Kind, recv_exact
from shoal.comm.transport.frames import Payload
from shoal.errors import PeerFailure

if TYPE_CHECKING:
    from shoal.comm.transport.link import LinkOwner

log = logging.getLogger(__name__)

MAX_ABORT_TEXT = 1 << 16
# Large payloads are read in pieces of this size, so that a long frame counts as hearing from the peer.
_PIECE = 4 << 20
_UNNUMBERED = (Kind.ACK, Kind.HEARTBEAT)


class _Restarted(Exception):
    """The connection was replaced while reading: the stream goes on from the next frame not yet received."""


class Reading:
    """The receiving half of `PeerLink` (link.py), which holds the state declared here and sets it up."""

    rank: int
    _owner: LinkOwner
    received: int
    last_heard: float
    _sock: socket.socket
    _gone: PeerFailure | None
    _lane_out: lanes.Outbound | None
    _lane_in: lanes.Inbound | None
    _header_buffer: bytearray
    _ack_due: bool

    def _read_loop(self) -> None:
        on_reader_thread.active = True
        try:
            while True:
                try:
                    header = self._read_header()
                    if header.kind in _UNNUMBERED:
                        continue
                    if header.number <= self.received:
                        self._discard(header)  # sent again after a reconnect, but we have it
                        continue
                    if header.number != self.received + 1:
                        raise ConnectionError(f"frame {header.number} came after frame {self.received}")
                    if not self._take(header):
                        return
                except _Restarted:
                    continue
        except PeerFailure:
            return  # the owner has been told
        except OSError as exc:
            if not self._owner.closed:  # else close() shut the socket to wake us: nobody is lost
                self._owner.link_lost(self.rank, f"connection lost ({exc})")
        except Exception as exc:  # a reader that dies must not leave its receives waiting
            log.exception("reader for rank %d failed", self.rank)
            self._owner.link_lost(self.rank, f"reader failed ({exc!r})")
        finally:
            if self._gone is None:  # closing: nothing more will be acknowledged
                self.fail(PeerFailure(self.rank, "the connection was closed"))
            self._close_sockets()

    def _take(self, header: FrameHeader) -> bool:
        """Act on one new numbered frame; False once the peer has said goodbye."""
        if header.kind == Kind.DATA:
            self._owner.on_data(self, header, self._payload(header))
        elif header.kind == Kind.SHM_OFFER and header.nbytes <= 256:
            self._accept_lane(self._read_small(header.nbytes).decode(errors="replace"))
        elif header.kind == Kind.SHM_ACCEPT and self._lane_out is not None:
            self._lane_out.accepted()
        elif header.kind == Kind.ABORT and header.nbytes <= MAX_ABORT_TEXT:
            self._owner.on_abort(self, header, self._read_small(header.nbytes).decode(errors="replace"))
        elif header.kind != Kind.BYE:
            raise ConnectionError(f"malformed frame ({header.kind.name}, {header.nbytes} bytes)")
        self.received = header.number
        if header.flags & ACK_NOW:
            self._ack_due = True
            self._flush_ack()
        if header.kind == Kind.BYE:
            self.fail(self._owner.on_bye(self))
            return False
        return True

    def _read_header(self) -> FrameHeader:
        raw = self._header_buffer
        self._recv(memoryview(raw))
        try:
            header = FrameHeader.unpack(raw)
        except ValueError:
            raise ConnectionError(f"malformed frame (kind {raw[0]})") from None
        if header.ack:
            self._acknowledged(header.ack)
        return header

    def _recv(self, view: memoryview) -> None:
        """Read exactly `view` from the current connection; heal it and raise _Restarted if it drops."""
        sock = self._sock
        try:
            while view:
                piece, view = view[:_PIECE], view[_PIECE:]
                recv_exact(sock, piece)
                self.last_heard = time.monotonic()
        except OSError as exc:
            if self._owner.closed or self._gone is not None:
                raise
            self._heal(sock, exc)
            raise _Restarted from None

    def _fill(self, view: memoryview, number: int) -> None:
        """Read frame `number`'s payload into `view`, over as many connections as it takes."""
        restarted = False
        while True:
            try:
                if restarted:
                    self._seek(number)
                self._recv(view)
                return
            except _Restarted:
                restarted = True

    def _seek(self, number: int) -> None:
        """On a new connection, read up to the header of frame `number` again."""
        while True:
            header = self._read_header()
            if header.kind in _UNNUMBERED:
                continue
            if header.number == number:
                return
            if header.number > number:
                raise ConnectionError(f"frame {header.number} was replayed where frame {number} was due")
            self._discard(header)

    def _discard(self, header: FrameHeader) -> None:
        if header.slot == NO_SLOT and header.nbytes:
            self._recv(memoryview(bytearray(header.nbytes)))

    def _read_small(self, nbytes: int) -> bytes:
        data = bytearray(nbytes)
        self._recv(memoryview(data))
        return bytes(data)

    def _payload(self, header: FrameHeader) -> Payload:
        """The frame's payload for its consumer. The frame counts as received (and is acknowledged by
        the next header we write) as soon as its payload is in, before the consumer acts on it: a peer
        woken by it may say goodbye at once, and its goodbye must acknowledge this frame."""
        number = header.number
        if header.slot == NO_SLOT:
            def fill(view: memoryview) -> None:
                self._fill(view, number)
                self.received = number
            return Payload(fill, None)
        lane = self._lane_in
        if lane is None:
            raise ConnectionError(f"rank {self.rank} sent a shared-memory frame without a shared region")
        slot, nbytes = header.slot, header.nbytes

        def take(view: memoryview) -> None:
            lane.take(slot, view)
            self.received = number

        def lend() -> torch.Tensor | None:
            tensor = lane.lend(slot, nbytes)
            if tensor is not None:
                self.received = number
            return tensor
        return Payload(take, lend)
