"""A link's sending half: frames numbered in the order they are written, kept in the delivery window until the
peer acknowledges them, and the acknowledgements and heartbeats that keep the peer informed.

Frames go out through a send thread fed by an outbox (small ones may be written by the calling thread
instead). Every frame but acknowledgements and heartbeats carries a number; the peer's reader acknowledges
each one as soon as it is in, and until then the frame waits in the window, to be replayed if the connection
drops (healing.py). A large frame points into its sender's buffer, which is then not free until the
acknowledgement; a small one is copied, and its sender goes on once the kernel has it.
"""

from __future__ import annotations

import collections
import logging
import queue
import socket
import threading
import time
from typing import TYPE_CHECKING

from shoal.comm.shm import lanes
from shoal.comm.transport.frame_header import ACK_NOW, FrameHeader, Kind, send_frame
from shoal.comm.transport.frames import SendTracker
from shoal.errors import PeerFailure

if TYPE_CHECKING:
    from shoal.comm.transport.link import LinkOwner

log = logging.getLogger(__name__)

# Frames up to this size are written by the calling thread when nothing is queued for the peer:
# a thread hand-off costs more than the copy. Reader threads never write inline (see `send`).
INLINE_BYTES = 64 << 10
# Data frames up to this size that a sender waits on are copied into the window, and their sends end once the
# kernel has them, as gloo's do, rather than a round trip later when the peer acknowledges them: the copy is
# what a replay sends, so the caller may reuse its buffer at once. Larger frames are kept without a copy
# (a frame in a shared-memory slot is a copy already, and ends once written too).
COPY_BYTES = 256 << 10
on_reader_thread = threading.local()


class _SocketFull(Exception):
    """A write that must not block found no room in the socket's buffer."""


class Frame:
    """A numbered frame kept in the window until the peer acknowledges it."""

    __slots__ = ("header", "number", "payload", "tracker")

    def __init__(self, header: FrameHeader, number: int, payload: memoryview, tracker: SendTracker | None) -> None:
        self.header, self.number, self.payload, self.tracker = header, number, payload, tracker


class Delivery:
    """The sending half of `PeerLink` (link.py), which holds the state declared here and sets it up."""

    rank: int
    _owner: LinkOwner
    received: int
    last_sent: float
    _sock: socket.socket
    _outbox: queue.SimpleQueue
    _queued: int
    _finished: bool
    _write_lock: threading.Lock
    _state: threading.Lock
    _window: collections.deque[Frame]
    _next_number: int
    _broken: bool
    _replay_due: bool
    _reacknowledge: bool
    _retired: list[socket.socket]
    _gone: PeerFailure | None
    _acked_out: int
    _ack_due: bool
    _lane_out: lanes.Outbound | None

    def send(self, header: FrameHeader, payload: memoryview, tracker: SendTracker | None, *,
             eager: bool = False) -> None:
        """Send one frame without waiting; `tracker` settles when `payload` may be reused: when the peer
        has the frame, or for a data frame up to COPY_BYTES, once the kernel has it (or with the error
        that ended the link).

        Small frames (any frame with `eager`) are written by the calling thread when nothing is queued
        before them, so order is kept; a reader thread never writes inline: one blocked in a write could
        stop draining its socket while the peer's reader does the same."""
        if tracker is not None:
            tracker.add()
        if ((eager or len(payload) <= INLINE_BYTES) and not getattr(on_reader_thread, "active", False)
                and self._write_lock.acquire(blocking=False)):
            try:
                with self._state:
                    idle = self._queued == 0 and not self._finished  # after the goodbye, refused below
                written = self._write(header, payload, tracker) if idle else None
            finally:
                self._write_lock.release()
                self._flush_ack()
            if idle:
                self._settle_early(written)
                return
        self._enqueue(header, payload, tracker)

    def _enqueue(self, header: FrameHeader | None, payload: memoryview, tracker: SendTracker | None, *,
                 last: bool = False) -> None:
        """Queue a frame for the send thread; header None asks it only to write what is due (replay, ack).
        `last` lets the send thread end after it; from then on frames are refused, their trackers settled
        with the error."""
        with self._state:  # held while putting, so that nothing lands behind the send thread's last item
            refused = self._finished
            if not refused:
                self._queued += 1
                self._outbox.put((header, payload, tracker))
                if last:
                    self._finished = True
                    self._outbox.put(None)
        if refused and tracker is not None:
            tracker.settle(PeerFailure(self.rank, "this rank closed its connection to it"))

    def finish(self, tracker: SendTracker) -> None:
        """Say goodbye after everything queued, then let the send thread end; `tracker` settles when
        the peer has the goodbye. From here on, frames are refused."""
        tracker.add()
        self._enqueue(FrameHeader(Kind.BYE, flags=ACK_NOW), memoryview(b""), tracker, last=True)

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            header, payload, tracker = item
            written = None
            with self._write_lock:
                if header is not None:
                    written = self._write(header, payload, tracker)
                else:
                    self._write_due()
            self._settle_early(written)
            with self._state:
                self._queued -= 1
            self._flush_ack()

    def _write(self, header: FrameHeader, payload: memoryview, tracker: SendTracker | None) -> Frame | None:
        """Number a frame, keep it in the window and write it (a large one through the shared-memory lane
        when a slot is free). The caller holds the write lock, which makes it the lane's only writer.

        Returns the frame when the kernel has it and the window holds its bytes: the caller settles its
        tracker (`_settle_early`) once it has let the lock go, as the tracker's callbacks may send."""
        owned = False  # whether the window holds the bytes themselves (a copy, or a shared-memory slot)
        if header.kind == Kind.DATA and len(payload) > INLINE_BYTES and self._lane_out is not None:
            slot = self._lane_out.put(payload)
            if slot is not None:
                header, payload, owned = header._replace(slot=slot), memoryview(b""), True
        if header.kind == Kind.DATA and tracker is not None and not owned and len(payload) <= COPY_BYTES:
            payload, owned = memoryview(bytes(payload)), True
        with self._state:
            error = self._gone
            if error is None:
                frame = Frame(header, self._next_number, payload, tracker)
                self._next_number += 1
                self._window.append(frame)
                if self._broken:
                    return None  # replayed once a new connection is in
                replay, self._replay_due = self._replay_due, False
                sock = self._sock
                frames = list(self._window) if replay else [frame]
        if error is not None:
            if tracker is not None:
                tracker.settle(error)
            return None
        written = self._transmit_all(frames, sock)
        return frame if written and owned and tracker is not None else None

    def _settle_early(self, frame: Frame | None) -> None:
        """Tell a frame's sender it may go on before the peer acknowledges it: the kernel has the frame and
        the window its bytes. Settled once: the acknowledgement, or the link's end, may have come first."""
        if frame is None:
            return
        with self._state:
            tracker, frame.tracker = frame.tracker, None
        if tracker is not None:
            try:
                tracker.settle(None)
            except Exception:  # a callback's fault must not end the send thread, stranding the peer's queue
                log.exception("settling a send to rank %d failed", self.rank)

    def _write_due(self) -> None:
        """Replay the window onto a new connection, or write an acknowledgement that is due (on a new
        connection, always one: see `Healing._heal`). The caller holds the write lock."""
        with self._state:
            retired, self._retired = self._retired, []
            usable = not self._broken and self._gone is None
            replay = usable and self._replay_due
            self._replay_due = self._replay_due and not usable
            reacknowledge = usable and self._reacknowledge
            self._reacknowledge = self._reacknowledge and not usable
            sock = self._sock
            frames = list(self._window) if replay else []
        for old in retired:
            old.close()
        if not usable:
            return
        if frames:
            self._transmit_all(frames, sock)
        elif self.received > self._acked_out or reacknowledge:
            self._transmit(Frame(FrameHeader(Kind.ACK), 0, memoryview(b""), None), sock)

    def _transmit_all(self, frames: list[Frame], sock: socket.socket) -> bool:
        """Write `frames` in order; False when one failed (the rest waits in the window for the next connection)."""
        return all(self._transmit(frame, sock) for frame in frames)

    def _transmit(self, frame: Frame, sock: socket.socket, flags: int = 0) -> bool:
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
            self._transmit(Frame(FrameHeader(kind), 0, memoryview(b""), None), sock, socket.MSG_DONTWAIT)
        except _SocketFull:
            self._enqueue(None, memoryview(b""), None)

    def heartbeat(self, now: float, interval: float, timeout: float, peer_heard: float) -> None:
        """Called periodically: say we are alive when we have said nothing for `interval`. When the peer has
        said nothing here, not even a heartbeat, for `timeout`, give it up; unless it was heard on another of
        our connections to it since (`peer_heard`): then the network under this one is down, and the
        connection is healed (healing.py), over another network if this one stays down."""
        if self._broken or self._gone is not None:
            return
        if now - self.last_heard > timeout:
            if now - peer_heard <= timeout:
                self.drop(f"it was silent for {timeout:g}s while the peer was heard on another", timeout)
                return
            self._owner.link_lost(self.rank, f"nothing heard from it for {timeout:g}s, not even a heartbeat: it "
                                             f"is stopped or stuck, or the network between us is down")
        elif now - self.last_sent >= interval and self._write_lock.acquire(blocking=False):
            try:  # a writer holding the lock is about to be heard anyway
                self._control(Kind.HEARTBEAT)
            finally:
                self._write_lock.release()
            self._flush_ack()  # a frame read meanwhile found the lock taken by this heartbeat

    def _acknowledged(self, number: int) -> None:
        try:
            if self._window[0].number > number:
                return  # nothing new: most headers repeat the acknowledgement before them
        except IndexError:  # nothing is waiting for one
            return
        settled = []
        with self._state:
            while self._window and self._window[0].number <= number:
                frame = self._window.popleft()
                if frame.tracker is not None:
                    settled.append(frame.tracker)
                    frame.tracker = None
        for tracker in settled:
            tracker.settle(None)
