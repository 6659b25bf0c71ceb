"""One rank's connection to one peer: the socket, a send thread fed by an outbox (small frames may be
written by the calling thread instead), a reader thread that parses frames and hands them on, and the
shared-memory lanes that carry large payloads between ranks on one host."""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Callable
from typing import Protocol

import torch

from shoal.comm import shm
from shoal.comm.frame_header import NO_SLOT, SIZE, FrameHeader, Kind, recv_exact, send_frame
from shoal.comm.frames import Payload, SendTracker
from shoal.errors import PeerFailure

log = logging.getLogger(__name__)

MAX_ABORT_TEXT = 1 << 16
# Frames up to this size are written by the calling thread when nothing is queued for the peer:
# a thread hand-off costs more than the copy. Reader threads never write inline (see `send`).
INLINE_BYTES = 64 << 10
_on_reader_thread = threading.local()


class LinkOwner(Protocol):
    """What a link reports to the transport that owns it; every call comes from the link's reader
    thread, except `send_failed` (any writer)."""

    closed: bool

    def on_data(self, link: PeerLink, header: FrameHeader, payload: Payload) -> None:
        """Take one DATA frame; its payload must be read (filled or lent) before returning."""

    def on_abort(self, link: PeerLink, header: FrameHeader, text: str) -> None: ...

    def on_bye(self, link: PeerLink) -> None: ...

    def link_lost(self, rank: int, reason: str) -> PeerFailure: ...

    def send_failed(self, rank: int, exc: OSError) -> PeerFailure: ...

    def failure(self, rank: int) -> PeerFailure | None: ...


class PeerLink:
    def __init__(self, owner: LinkOwner, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self._owner = owner
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0  # frames put in the outbox and not yet written; guarded by _count_lock
        self._count_lock = threading.Lock()
        self._write_lock = threading.Lock()  # one writer at a time: the send thread or an inline sender
        self._lane_out: shm.Outbound | None = None
        self._lane_in: shm.Inbound | None = None

    def start(self, start_thread: Callable[..., None]) -> None:
        """Start reading and sending, offering a shared-memory lane first where this host has them."""
        start_thread(self._read_loop, name=f"shoal-read-{self.rank}")
        if shm.available():
            self._lane_out = shm.Outbound()
            name = self._lane_out.name.encode()
            self._enqueue(FrameHeader(Kind.SHM_OFFER, len(name)), memoryview(name), None)
        start_thread(self._send_loop, name=f"shoal-send-{self.rank}")

    # ---- sending -----------------------------------------------------------------------------------

    def send(self, header: FrameHeader, payload: memoryview, tracker: SendTracker | None, *,
             eager: bool = False) -> None:
        """Send one frame without waiting; `tracker` settles when `payload` may be reused.

        Small frames (any frame with `eager`) are written by the calling thread when nothing is queued
        before them, so order is kept; a reader thread never writes inline: one blocked in a write could
        stop draining its socket while the peer's reader does the same."""
        if tracker is not None:
            tracker.add()
        if ((eager or len(payload) <= INLINE_BYTES) and not getattr(_on_reader_thread, "active", False)
                and self._write_lock.acquire(blocking=False)):
            try:
                with self._count_lock:
                    idle = self._queued == 0
                if idle:
                    error = None
                    try:
                        self._write(header, payload)
                    except OSError as exc:
                        error = self._owner.send_failed(self.rank, exc)
                    if tracker is not None:
                        tracker.settle(error)
                    return
            finally:
                self._write_lock.release()
        self._enqueue(header, payload, tracker)

    def _enqueue(self, header: FrameHeader, payload: memoryview, tracker: SendTracker | None) -> None:
        with self._count_lock:
            self._queued += 1
        self._outbox.put((header, payload, tracker))

    def finish(self, tracker: SendTracker) -> None:
        """Say goodbye after everything queued, then let the send thread end; `tracker` settles when
        the goodbye is written."""
        tracker.add()
        self._enqueue(FrameHeader(Kind.BYE), memoryview(b""), tracker)
        self._outbox.put(None)

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            header, payload, tracker = item
            error = self._owner.failure(self.rank)
            if error is None:
                try:
                    with self._write_lock:
                        self._write(header, payload)
                except OSError as exc:
                    error = self._owner.send_failed(self.rank, exc)
            with self._count_lock:
                self._queued -= 1
            if tracker is not None:
                tracker.settle(error)

    def _write(self, header: FrameHeader, payload: memoryview) -> None:
        """Write one frame, a large one through the shared-memory lane when there is a free slot.
        The caller holds the write lock (which also makes it the lane's only writer)."""
        if header.kind == Kind.DATA and len(payload) > INLINE_BYTES and self._lane_out is not None:
            slot = self._lane_out.put(payload)
            if slot is not None:
                header, payload = header._replace(slot=slot), memoryview(b"")
        send_frame(self.sock, header.pack(), payload)

    # ---- receiving ---------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        _on_reader_thread.active = True
        raw = bytearray(SIZE)
        try:
            while True:
                recv_exact(self.sock, memoryview(raw))
                try:
                    header = FrameHeader.unpack(raw)
                except ValueError:
                    raise ConnectionError(f"malformed frame (kind {raw[0]})") from None
                if header.kind == Kind.DATA:
                    self._owner.on_data(self, header, self._payload(header))
                elif header.kind == Kind.SHM_OFFER and header.nbytes <= 256:
                    self._accept_lane(self._read_small(header.nbytes).decode(errors="replace"))
                elif header.kind == Kind.SHM_ACCEPT and self._lane_out is not None:
                    self._lane_out.accepted()
                elif header.kind == Kind.ABORT and header.nbytes <= MAX_ABORT_TEXT:
                    self._owner.on_abort(self, header, self._read_small(header.nbytes).decode(errors="replace"))
                elif header.kind == Kind.BYE:
                    self._owner.on_bye(self)
                    return
                else:
                    raise ConnectionError(f"malformed frame ({header.kind.name}, {header.nbytes} bytes)")
        except OSError as exc:
            if not self._owner.closed:  # else close() shut the socket to wake us: nobody is lost
                self._owner.link_lost(self.rank, f"connection lost ({exc})")
        except Exception as exc:  # a reader that dies must not leave its receives waiting
            log.exception("reader for rank %d failed", self.rank)
            self._owner.link_lost(self.rank, f"reader failed ({exc!r})")
        finally:
            self.sock.close()

    def _read_small(self, nbytes: int) -> bytes:
        data = bytearray(nbytes)
        recv_exact(self.sock, memoryview(data))
        return bytes(data)

    def _payload(self, header: FrameHeader) -> Payload:
        if header.slot == NO_SLOT:
            return Payload(lambda view: recv_exact(self.sock, view), None)
        lane = self._lane_in
        if lane is None:
            raise ConnectionError(f"rank {self.rank} sent a shared-memory frame without a shared region")
        slot, nbytes = header.slot, header.nbytes
        lend: Callable[[], torch.Tensor | None] = lambda: lane.lend(slot, nbytes)  # noqa: E731
        return Payload(lambda view: lane.take(slot, view), lend)

    def _accept_lane(self, name: str) -> None:
        try:
            self._lane_in = shm.Inbound(name)
        except (OSError, ValueError):
            return  # another host (or no /dev/shm): the peer keeps sending everything over TCP
        self._enqueue(FrameHeader(Kind.SHM_ACCEPT), memoryview(b""), None)

    # ---- teardown ----------------------------------------------------------------------------------

    def shutdown(self, how: int) -> None:
        """Shut the socket down (wakes a reader blocked on it); an already closed one is fine."""
        try:
            self.sock.shutdown(how)
        except OSError:
            pass

    def release_lane(self) -> None:
        if self._lane_out is not None:
            self._lane_out.close_descriptor()
