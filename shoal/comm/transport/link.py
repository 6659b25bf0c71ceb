"""One rank's connection to one peer, which survives the loss of its TCP connection.

Frames go out through a send thread fed by an outbox (small ones may be written by the calling thread
instead) and come in on a reader thread that parses them and hands them on. Every frame but
acknowledgements and heartbeats carries a number; the reader acknowledges each one as soon as it is
in, and the sender keeps a frame (and the buffer it points into: nothing is copied) in its replay
window until then. When the connection drops while both processes live, the higher rank dials again,
both sides authenticate, tell each other the last frame they received, and the sender replays the rest;
the receiver drops any frame it already has, so every frame is delivered exactly once and in order.
Large payloads between ranks on one host travel through shared-memory lanes, which outlive the socket.
"""

from __future__ import annotations

import collections
import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from shoal.comm.shm import lanes
from shoal.comm.transport.frame_header import ACK_NOW, NO_SLOT, SIZE, FrameHeader, Kind, recv_exact, send_frame
from shoal.comm.transport.frames import Payload, SendTracker
from shoal.errors import PeerFailure
from shoal.observe import events

log = logging.getLogger(__name__)

MAX_ABORT_TEXT = 1 << 16
# Frames up to this size are written by the calling thread when nothing is queued for the peer:
# a thread hand-off costs more than the copy. Reader threads never write inline (see `send`).
INLINE_BYTES = 64 << 10
# Large payloads are read in pieces of this size, so that a long frame counts as hearing from the peer.
_PIECE = 4 << 20
# Sent by both ends of a new connection, after authenticating: the last frame number each has received,
# and the port its listener is on (where the other end dials, or probes whether this process lives).
_RESUME = struct.Struct("<QH")
_UNNUMBERED = (Kind.ACK, Kind.HEARTBEAT)
_on_reader_thread = threading.local()


def resume_handshake(sock: socket.socket, received: int, listen_port: int) -> tuple[int, int]:
    """Exchange (last frame received, listener port) with the peer on a freshly authenticated socket."""
    sock.sendall(_RESUME.pack(received, listen_port))
    reply = bytearray(_RESUME.size)
    recv_exact(sock, memoryview(reply))
    return _RESUME.unpack(reply)


class LinkOwner(Protocol):
    """What a link asks of, and reports to, the transport that owns it; calls come from the link's
    reader thread."""

    closed: bool

    def on_data(self, link: PeerLink, header: FrameHeader, payload: Payload) -> None:
        """Take one DATA frame; its payload must be read (filled or lent) before returning."""

    def on_abort(self, link: PeerLink, header: FrameHeader, text: str) -> None: ...

    def on_bye(self, link: PeerLink) -> PeerFailure:
        """The peer said goodbye after its last frame; the error for anything still sent to it."""

    def link_lost(self, rank: int, reason: str) -> PeerFailure:
        """The link cannot be healed: fail everything that involves `rank`."""

    def redial(self, link: PeerLink, address: tuple[str, int], deadline: float) -> tuple[socket.socket, int]:
        """A new authenticated, resumed connection to the peer (the socket and the peer's last received
        frame); PeerFailure when its process is gone, TimeoutError at `deadline`."""


class _SocketFull(Exception):
    """A write that must not block found no room in the socket's buffer."""


class _Restarted(Exception):
    """The connection was replaced while reading: the stream goes on from the next frame not yet received."""


class _Frame:
    __slots__ = ("header", "number", "payload", "tracker")

    def __init__(self, header: FrameHeader, number: int, payload: memoryview, tracker: SendTracker | None) -> None:
        self.header, self.number, self.payload, self.tracker = header, number, payload, tracker


class PeerLink:
    """The connection to one peer; `dialer` when this rank dials it (the higher rank of the two)."""

    def __init__(self, owner: LinkOwner, rank: int, sock: socket.socket, *, dialer: bool,
                 peer_port: int, heal_timeout: float) -> None:
        self.rank = rank
        self._owner = owner
        self._sock = sock
        self._dialer = dialer
        self._address = (sock.getpeername()[0], peer_port)
        self._heal_timeout = heal_timeout
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0  # frames put in the outbox and not yet written; guarded by _state
        # One writer at a time (the send thread, an inline sender, an acknowledgement): frames are
        # numbered in the order they are written, and the lane has one writer.
        self._write_lock = threading.Lock()
        self._state = threading.Lock()  # the window, the socket and the replacement below
        # For waiting on a replacement or the end: a plain lock is what the hot paths take, since a
        # Condition's `with` costs two Python calls per use and a frame takes the lock several times.
        self._state_changed = threading.Condition(self._state)
        # Frames written and not yet acknowledged: bounded by what the socket buffers and the lane's slots
        # hold unread (the reader acknowledges at once), and while healing by the heal deadline.
        self._window: collections.deque[_Frame] = collections.deque()
        self._next_number = 1
        self._broken = False  # the socket failed; frames wait in the window until a new one is in
        self._replay_due = False  # a new socket is in; the window goes out before anything else
        self._replacement: tuple[socket.socket, int] | None = None  # a redial the peer made to us
        # Connections replaced, shut down but not closed: a writer may still hold one, and closing it
        # would free its descriptor number for reuse under that writer. Closed under the write lock.
        self._retired: list[socket.socket] = []
        self._gone: PeerFailure | None = None
        self.received = 0  # the last frame number read in full (reader thread only)
        self._acked_out = 0  # the last number we acknowledged to the peer
        self._ack_due = False
        self.last_heard = self.last_sent = time.monotonic()
        self._lane_out: lanes.Outbound | None = None
        self._lane_in: lanes.Inbound | None = None
        self._header_buffer = bytearray(SIZE)  # the reader's, reused for every header

    def start(self, start_thread: Callable[..., None]) -> None:
        """Start reading and sending, offering a shared-memory lane first where this host has them."""
        start_thread(self._read_loop, name=f"shoal-read-{self.rank}")
        if lanes.available():
            self._lane_out = lanes.Outbound()
            name = self._lane_out.name.encode()
            self._enqueue(FrameHeader(Kind.SHM_OFFER, len(name)), memoryview(name), None)
        start_thread(self._send_loop, name=f"shoal-send-{self.rank}")

    # ---- sending -----------------------------------------------------------------------------------

    def send(self, header: FrameHeader, payload: memoryview, tracker: SendTracker | None, *,
             eager: bool = False) -> None:
        """Send one frame without waiting; `tracker` settles when the peer has it, so `payload` may be
        reused (or with the error that ended the link).

        Small frames (any frame with `eager`) are written by the calling thread when nothing is queued
        before them, so order is kept; a reader thread never writes inline: one blocked in a write could
        stop draining its socket while the peer's reader does the same."""
        if tracker is not None:
            tracker.add()
        if ((eager or len(payload) <= INLINE_BYTES) and not getattr(_on_reader_thread, "active", False)
                and self._write_lock.acquire(blocking=False)):
            try:
                with self._state:
                    idle = self._queued == 0
                if idle:
                    self._write(header, payload, tracker)
                    return
            finally:
                self._write_lock.release()
                self._flush_ack()
        self._enqueue(header, payload, tracker)

    def _enqueue(self, header: FrameHeader | None, payload: memoryview, tracker: SendTracker | None) -> None:
        """Queue a frame for the send thread; header None asks it only to write what is due (replay, ack)."""
        with self._state:
            self._queued += 1
        self._outbox.put((header, payload, tracker))

    def finish(self, tracker: SendTracker) -> None:
        """Say goodbye after everything queued, then let the send thread end; `tracker` settles when
        the peer has the goodbye."""
        tracker.add()
        self._enqueue(FrameHeader(Kind.BYE, flags=ACK_NOW), memoryview(b""), tracker)
        self._outbox.put(None)

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            header, payload, tracker = item
            with self._write_lock:
                if header is not None:
                    self._write(header, payload, tracker)
                else:
                    self._write_due()
            with self._state:
                self._queued -= 1
            self._flush_ack()

    def _write(self, header: FrameHeader, payload: memoryview, tracker: SendTracker | None) -> None:
        """Number a frame, keep it in the window and write it (a large one through the shared-memory lane
        when a slot is free). The caller holds the write lock, which makes it the lane's only writer."""
        if header.kind == Kind.DATA and len(payload) > INLINE_BYTES and self._lane_out is not None:
            slot = self._lane_out.put(payload)
            if slot is not None:
                header, payload = header._replace(slot=slot), memoryview(b"")
        with self._state:
            error = self._gone
            if error is None:
                frame = _Frame(header, self._next_number, payload, tracker)
                self._next_number += 1
                self._window.append(frame)
                if self._broken:
                    return  # replayed once a new connection is in
                replay, self._replay_due = self._replay_due, False
                sock = self._sock
                frames = list(self._window) if replay else [frame]
        if error is not None:
            if tracker is not None:
                tracker.settle(error)
            return
        self._transmit_all(frames, sock)

    def _write_due(self) -> None:
        """Replay the window onto a new connection, or write an acknowledgement that is due. The caller
        holds the write lock."""
        with self._state:
            retired, self._retired = self._retired, []
            usable = not self._broken and self._gone is None
            replay = usable and self._replay_due
            self._replay_due = self._replay_due and not usable
            sock = self._sock
            frames = list(self._window) if replay else []
        for old in retired:
            old.close()
        if not usable:
            return
        if frames:
            self._transmit_all(frames, sock)
        elif self.received > self._acked_out:
            self._transmit(_Frame(FrameHeader(Kind.ACK), 0, memoryview(b""), None), sock)

    def _transmit_all(self, frames: list[_Frame], sock: socket.socket) -> None:
        for frame in frames:
            if not self._transmit(frame, sock):
                return  # the rest waits in the window for the next connection

    def _transmit(self, frame: _Frame, sock: socket.socket, flags: int = 0) -> bool:
        """Write one frame, with our latest acknowledgement, on `sock` (the connection current when it was
        numbered: a newer one gets the window replayed first). False when the write failed: the link is
        then broken, and the reader heals it."""
        ack = self.received
        data = frame.header.pack(frame.number, ack)
        try:
            if flags:
                try:
                    sent = sock.send(data, flags)
                except BlockingIOError:
                    raise _SocketFull from None
                if sent < len(data):
                    sock.sendall(data[sent:])  # rare: never leave half a header on the stream
            else:
                send_frame(sock, data, frame.payload)
        except OSError as exc:  # a write that stalled past SO_SNDTIMEO too: heal and replay
            self._break(sock, exc)
            return False
        self._acked_out = max(self._acked_out, ack)
        self.last_sent = time.monotonic()
        return True

    def _flush_ack(self) -> None:
        """Acknowledge what the reader has taken in, unless another writer holds the lock: that one
        will, as its frame carries the acknowledgement or as it calls this again after letting go."""
        while self._ack_due and self._write_lock.acquire(blocking=False):
            try:
                self._ack_due = False
                if self.received > self._acked_out:
                    self._control(Kind.ACK)
            finally:
                self._write_lock.release()

    def _control(self, kind: Kind) -> None:
        """Write an acknowledgement or heartbeat without blocking (the caller may be the reader); when
        the socket is full, the send thread writes what is due instead. The caller holds the write lock."""
        with self._state:
            if self._broken or self._replay_due or self._gone is not None:
                return  # the replay carries the acknowledgement; a heartbeat can wait
            sock = self._sock
        try:
            self._transmit(_Frame(FrameHeader(kind), 0, memoryview(b""), None), sock, socket.MSG_DONTWAIT)
        except _SocketFull:
            self._enqueue(None, memoryview(b""), None)

    def heartbeat(self, now: float, interval: float, timeout: float) -> None:
        """Called periodically: say we are alive when we have said nothing for `interval`, and give the
        peer up when it has said nothing, not even a heartbeat, for `timeout`."""
        if self._broken or self._gone is not None:
            return
        if now - self.last_heard > timeout:
            self._owner.link_lost(self.rank, f"nothing heard from it for {timeout:g}s, not even a heartbeat: it "
                                             f"is stopped or stuck, or the network between us is down")
        elif now - self.last_sent >= interval and self._write_lock.acquire(blocking=False):
            try:  # a writer holding the lock is about to be heard anyway
                self._control(Kind.HEARTBEAT)
            finally:
                self._write_lock.release()

    def _acknowledged(self, number: int) -> None:
        try:
            if self._window[0].number > number:
                return  # nothing new: most headers repeat the acknowledgement before them
        except IndexError:  # nothing is waiting for one
            return
        settled = []
        with self._state:
            while self._window and self._window[0].number <= number:
                settled.append(self._window.popleft())
        for frame in settled:
            if frame.tracker is not None:
                frame.tracker.settle(None)

    # ---- receiving ---------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        _on_reader_thread.active = True
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

    def _accept_lane(self, name: str) -> None:
        try:
            self._lane_in = lanes.Inbound(name)
        except (OSError, ValueError):
            return  # another host (or no /dev/shm): the peer keeps sending everything over TCP
        self._enqueue(FrameHeader(Kind.SHM_ACCEPT), memoryview(b""), None)

    # ---- healing -----------------------------------------------------------------------------------

    def _break(self, sock: socket.socket, exc: OSError) -> None:
        """A write on `sock` failed: frames wait in the window; the reader, woken here, heals the link."""
        with self._state:
            if sock is not self._sock:
                return  # an old connection, already replaced
            self._broken = True
        log.info("connection to rank %d broke while writing (%s); healing", self.rank, exc)
        _shut(sock)

    def replace(self, sock: socket.socket, peer_received: int) -> None:
        """The peer dialled us again (it found the connection broken first, or so did we)."""
        with self._state:
            if self._gone is not None:
                sock.close()
                return
            old, self._replacement = self._replacement, (sock, peer_received)
            current = self._sock
            self._broken = True
            self._state_changed.notify_all()
        if old is not None:
            old[0].close()
        _shut(current)  # the reader, if still on it, moves to the new connection

    def _heal(self, sock: socket.socket, exc: OSError) -> None:
        """Replace a dropped connection (reader thread): dial again or wait to be dialled, until the
        heal deadline; PeerFailure (after telling the owner) when the peer's process is gone or the
        deadline passes."""
        with self._state:
            self._broken = True
            self._retired.append(sock)
        _shut(sock)
        log.info("connection to rank %d dropped (%s); healing", self.rank, exc)
        healing = events.begin()
        deadline = time.monotonic() + self._heal_timeout
        try:
            new, peer_received = (self._owner.redial(self, self._address, deadline) if self._dialer
                                  else self._await_redial(deadline))
        except PeerFailure as failure:
            raise self._owner.link_lost(self.rank, failure.detail) from None
        except TimeoutError:
            raise self._owner.link_lost(self.rank, f"the connection dropped ({exc}) and could not be restored "
                                                   f"within {self._heal_timeout:g}s") from None
        self._acknowledged(peer_received)
        with self._state:
            if self._gone is not None or self._owner.closed:  # given up or closed while we healed
                new.close()
                raise self._gone or PeerFailure(self.rank, "the transport closed while the link healed")
            self._sock, self._broken = new, False
            self._replay_due = bool(self._window)
            self.last_heard = time.monotonic()
        self._enqueue(None, memoryview(b""), None)  # the send thread replays (never the reader: see send)
        log.info("connection to rank %d restored", self.rank)
        events.complete(f"link to rank {self.rank} healed", events.FAULT, healing, peer=self.rank, cause=str(exc),
                        frames_to_resend=len(self._window))

    def _await_redial(self, deadline: float) -> tuple[socket.socket, int]:
        """Wait for the peer to dial us again, checking between waits that its process still listens."""
        delay = 0.05
        while True:
            with self._state:
                if self._state_changed.wait_for(lambda: self._replacement is not None or self._gone is not None,
                                                timeout=max(0.0, min(delay, deadline - time.monotonic()))):
                    if self._gone is not None:
                        raise self._gone
                    found, self._replacement = self._replacement, None
                    return found
            if time.monotonic() >= deadline:
                raise TimeoutError
            _probe(self._address, self.rank)
            delay = min(2 * delay, 0.5)

    # ---- failure and teardown ----------------------------------------------------------------------

    def fail(self, error: PeerFailure) -> None:
        """The link is over (the peer is lost or left): settle every frame it still holds with `error`."""
        with self._state:
            self._gone = error
            frames = list(self._window)
            self._window.clear()
            self._state_changed.notify_all()
            replacement, self._replacement = self._replacement, None
        if replacement is not None:
            replacement[0].close()
        for frame in frames:
            if frame.tracker is not None:
                frame.tracker.settle(error)

    def _close_sockets(self) -> None:
        """Close every connection the link had: shut down first, which wakes a writer blocked on one (closing
        would not), then closed under the write lock, so that no writer is between reading a descriptor
        number and using it when closing frees that number for another socket."""
        with self._state:
            sockets, self._retired = [*self._retired, self._sock], []
        for sock in sockets:
            _shut(sock)
        with self._write_lock:
            for sock in sockets:
                sock.close()

    def shutdown(self, how: int) -> None:
        """Shut the socket down (wakes a reader blocked on it); an already closed one is fine."""
        try:
            self._sock.shutdown(how)
        except OSError:
            pass

    def sever(self) -> None:
        """Drop the connection as a network fault would (a reset, both processes living on)."""
        sock = self._sock
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        _shut(sock)

    def release_lane(self) -> None:
        if self._lane_out is not None:
            self._lane_out.close_descriptor()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def process_gone(rank: int) -> PeerFailure:
    """A dropped connection whose peer's listener refuses connections: not a link to heal."""
    return PeerFailure(rank, "its process is gone (its listener refuses connections)")


def _probe(address: tuple[str, int], rank: int) -> None:
    """PeerFailure if nothing listens at the peer's listener address any more: its process is gone."""
    try:
        with socket.create_connection(address, timeout=1.0):
            pass
    except ConnectionRefusedError:
        raise process_gone(rank) from None
    except OSError:
        pass  # unreachable for now: the deadline decides
