"""One rank's connection to one peer, which survives the loss of its TCP connection.

A `PeerLink` is one object with one lock; what it does is told in three files: sending, numbering and the
delivery window (delivery.py), reading (reading.py), and healing a dropped connection (healing.py). This
file holds its state, starts it, offers the shared-memory lane that large payloads to a peer on the same
host travel through (which outlives the socket), and ends it.
"""

from __future__ import annotations

import collections
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Protocol

from shoal.comm.shm import lanes
from shoal.comm.transport.delivery import Delivery, Frame
from shoal.comm.transport.frame_header import SIZE, FrameHeader, Kind
from shoal.comm.transport.frames import Payload
from shoal.comm.transport.healing import Healing, shut
from shoal.comm.transport.reading import Reading
from shoal.errors import PeerFailure


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


class PeerLink(Delivery, Reading, Healing):
    """A connection to one peer; `dialer` when this rank dials it (the higher rank of the two). `stream`
    numbers the pair's connections where it has several (config.SHOAL_STREAMS); only the first carries
    small frames and offers shared memory."""

    def __init__(self, owner: LinkOwner, rank: int, sock: socket.socket, *, dialer: bool,
                 peer_port: int, heal_timeout: float, stream: int = 0) -> None:
        self.rank, self.stream = rank, stream
        self._owner = owner
        self._sock = sock
        self.dialer = dialer
        self._address = (sock.getpeername()[0], peer_port)
        self._heal_timeout = heal_timeout
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0  # frames put in the outbox and not yet written; guarded by _state
        self._finished = False  # the goodbye is queued and the send thread ends after it; guarded by _state
        # One writer at a time (the send thread, an inline sender, an acknowledgement): frames are
        # numbered in the order they are written, and the lane has one writer.
        self._write_lock = threading.Lock()
        self._state = threading.Lock()  # the window, the socket and the replacement below
        # For waiting on a replacement or the end: a plain lock is what the hot paths take, since a
        # Condition's `with` costs two Python calls per use and a frame takes the lock several times.
        self._state_changed = threading.Condition(self._state)
        # Frames written and not yet acknowledged: bounded by what the socket buffers and the lane's slots
        # hold unread (the reader acknowledges at once), and while healing by the heal deadline.
        self._window: collections.deque[Frame] = collections.deque()
        self._next_number = 1
        self._broken = False  # the socket failed; frames wait in the window until a new one is in
        self._replay_due = False  # a new socket is in; the window goes out before anything else
        self._reacknowledge = False  # a new socket is in; an acknowledgement goes out on it (Healing._heal)
        self._replacement: tuple[socket.socket, int] | None = None  # a redial the peer made to us
        self._dropped: tuple[str, float] | None = None  # why we gave the connection up, and extra time to heal it
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
        suffix = f"-{self.stream}" if self.stream else ""
        start_thread(self._read_loop, name=f"shoal-read-{self.rank}{suffix}")
        if self.stream == 0 and lanes.available():
            self._lane_out = lanes.Outbound()
            name = self._lane_out.name.encode()
            self._enqueue(FrameHeader(Kind.SHM_OFFER, len(name)), memoryview(name), None)
        start_thread(self._send_loop, name=f"shoal-send-{self.rank}{suffix}")

    @property
    def ended(self) -> bool:
        """Whether nothing more will come on this link: it failed, or the peer said goodbye on it."""
        return self._gone is not None

    @property
    def shares_memory(self) -> bool:
        """Whether large frames to the peer go through shared memory (it is on this host)."""
        return self._lane_out is not None and self._lane_out.ready

    def _accept_lane(self, name: str) -> None:
        try:
            self._lane_in = lanes.Inbound(name)
        except (OSError, ValueError):
            return  # another host (or no /dev/shm): the peer keeps sending everything over TCP
        self._enqueue(FrameHeader(Kind.SHM_ACCEPT), memoryview(b""), None)

    def fail(self, error: PeerFailure) -> None:
        """The link is over (the peer is lost or left): settle every frame it still holds with `error`."""
        with self._state:
            self._gone = error
            trackers = [frame.tracker for frame in self._window if frame.tracker is not None]
            for frame in self._window:
                frame.tracker = None
            self._window.clear()
            self._state_changed.notify_all()
            replacement, self._replacement = self._replacement, None
        if replacement is not None:
            replacement[0].close()
        for tracker in trackers:
            tracker.settle(error)

    def _close_sockets(self) -> None:
        """Close every connection the link had: shut down first, which wakes a writer blocked on one (closing
        would not), then closed under the write lock, so that no writer is between reading a descriptor
        number and using it when closing frees that number for another socket."""
        with self._state:
            sockets, self._retired = [*self._retired, self._sock], []
        for sock in sockets:
            shut(sock)
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
        shut(sock)

    def release_lane(self) -> None:
        if self._lane_out is not None:
            self._lane_out.close_descriptor()
