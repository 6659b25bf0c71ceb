"""A link acknowledges every frame its peer asked to have acknowledged at once, whichever writer holds the
link when the frame arrives and across a healed connection: the sender's operation waits for that
acknowledgement (for a large frame), so one left lying costs it until our next write, up to about two heartbeat
intervals. A small frame is copied, and its sender goes on once the kernel has it; a replay sends the copy. And
a frame sent once the goodbye is queued is refused at once, not left waiting for a send thread that has ended."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from shoal.comm.transport.delivery import COPY_BYTES
from shoal.comm.transport.frame_header import ACK_NOW, SIZE, FrameHeader, Kind
from shoal.comm.transport.frames import SendTracker
from shoal.comm.transport.link import PeerLink
from shoal.errors import PeerFailure


def _connected() -> tuple[socket.socket, socket.socket]:
    """Both ends of a TCP connection on 127.0.0.1."""
    listener = socket.create_server(("127.0.0.1", 0))
    ours = socket.create_connection(listener.getsockname())
    theirs, _ = listener.accept()
    listener.close()
    return ours, theirs


@pytest.fixture
def link_and_peer() -> Iterator[tuple[PeerLink, socket.socket]]:
    """A link (no threads started) over a real TCP connection, and the peer's end of it."""
    ours, theirs = _connected()
    link = PeerLink(owner=None, rank=1, sock=ours, dialer=False, peer_port=0, heal_timeout=1.0)
    try:
        yield link, theirs
    finally:
        ours.close()
        theirs.close()


def _headers_until(peer: socket.socket, seen: Callable[[list[FrameHeader]], bool]) -> list[FrameHeader]:
    """The frame headers the link writes (they carry no payload here), read until `seen` says the one
    awaited is among them, or for 2 s."""
    headers: list[FrameHeader] = []
    raw = bytearray()
    peer.settimeout(0.1)
    deadline = time.monotonic() + 2
    while not seen(headers) and time.monotonic() < deadline:
        try:
            chunk = peer.recv(1 << 16)
        except TimeoutError:
            continue
        raw += chunk
        while len(raw) >= SIZE:
            headers.append(FrameHeader.unpack(raw[:SIZE]))
            del raw[:SIZE]
    return headers


def test_a_frame_that_arrives_while_a_heartbeat_is_written_is_acknowledged_when_the_heartbeat_lets_go(
        link_and_peer) -> None:
    link, peer = link_and_peer
    write = link._transmit

    def heartbeat_then_frame_arrives(frame, sock, flags=0):
        link._transmit = write
        written = write(frame, sock, flags)  # the heartbeat carries the acknowledgement before the frame
        # The reader takes frame 1, which asks for an acknowledgement now, and finds the heartbeat
        # holding the write lock (Reading._take).
        link.received = 1
        link._ack_due = True
        link._flush_ack()
        return written

    link._transmit = heartbeat_then_frame_arrives
    link.last_sent = time.monotonic() - 10
    now = time.monotonic()
    link.heartbeat(now, interval=1.0, timeout=100.0, peer_heard=now)

    headers = _headers_until(peer, lambda headers: any(header.ack == 1 for header in headers))
    assert headers[0].kind == Kind.HEARTBEAT and headers[0].ack == 0
    assert any(header.ack == 1 for header in headers), f"frame 1 was never acknowledged: {headers}"


class _Redialled:
    """A link's owner whose redial hands over `new`, the peer saying it has received nothing."""

    closed = False

    def __init__(self, new: socket.socket) -> None:
        self._new = new

    def redial(self, link, address, deadline):
        return self._new, 0


def _frames(peer: socket.socket, count: int) -> list[tuple[FrameHeader, bytes]]:
    """The next `count` frames the link writes to `peer`, payloads and all."""
    def exactly(n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = peer.recv(n - len(data))
            assert chunk, "the link closed the connection"
            data += chunk
        return bytes(data)

    peer.settimeout(5)
    frames = []
    for _ in range(count):
        header = FrameHeader.unpack(exactly(SIZE))
        frames.append((header, exactly(header.nbytes)))
    return frames


def test_a_small_frame_is_done_once_written_and_its_replay_sends_what_it_held_then() -> None:
    old, old_theirs = _connected()
    new, new_theirs = _connected()
    link = PeerLink(owner=_Redialled(new), rank=1, sock=old, dialer=True, peer_port=0, heal_timeout=1.0)
    try:
        buffer = bytearray(b"sent")
        done = SendTracker()
        link.send(FrameHeader(Kind.DATA, len(buffer), flags=ACK_NOW), memoryview(buffer), done)
        done.wait(time.monotonic() + 2, "a small frame, not acknowledged")  # written, never acknowledged
        buffer[:] = b"next"  # the caller reuses its buffer, as it may
        assert _frames(old_theirs, 1)[0][1] == b"sent"
        link._heal(old, ConnectionResetError("reset by a test"))  # the frame is lost with the connection
        link._outbox.put(None)
        link._send_loop()  # the replay, on this thread
        header, payload = _frames(new_theirs, 1)[0]
        assert (header.kind, header.number, payload) == (Kind.DATA, 1, b"sent")
    finally:
        for sock in (old, old_theirs, new, new_theirs):
            sock.close()


class _Counted(SendTracker):
    """A tracker that counts how often it is settled: a frame's tracker must be settled exactly once."""

    def __init__(self) -> None:
        super().__init__()
        self.settled: list[BaseException | None] = []

    def settle(self, error: BaseException | None) -> None:
        self.settled.append(error)
        super().settle(error)


def _send_through_thread(link: PeerLink, peer: socket.socket, payload: memoryview, tracker: SendTracker) -> None:
    """Send one frame through the link's send thread (run here until it is written), the peer reading it."""
    link.send(FrameHeader(Kind.DATA, len(payload), flags=ACK_NOW), payload, tracker)
    link._outbox.put(None)
    writer = threading.Thread(target=link._send_loop)
    writer.start()
    assert len(_frames(peer, 1)[0][1]) == len(payload)
    writer.join(timeout=5)
    assert not writer.is_alive()


def test_a_frame_over_the_copy_limit_is_done_only_when_acknowledged(link_and_peer) -> None:
    link, peer = link_and_peer
    done = _Counted()
    _send_through_thread(link, peer, memoryview(bytearray(COPY_BYTES + 1)), done)  # the caller's own memory
    with pytest.raises(TimeoutError):
        done.wait(time.monotonic() + 0.2, "a large frame, not acknowledged")
    link._acknowledged(1)
    link._acknowledged(1)
    link.fail(PeerFailure(1, "gone after acknowledging"))
    assert done.settled == [None]


def test_a_frame_the_send_thread_writes_is_done_once_written(link_and_peer) -> None:
    link, peer = link_and_peer
    done = _Counted()
    _send_through_thread(link, peer, memoryview(bytearray(COPY_BYTES)), done)  # larger than written inline
    assert done.settled == [None]
    link._acknowledged(1)
    assert done.settled == [None]


@pytest.mark.parametrize("first", ["acknowledged", "link lost"])
def test_a_small_frame_settles_once_when_the_acknowledgement_or_the_end_comes_before_its_write_returns(
        link_and_peer, first: str) -> None:
    link, _ = link_and_peer
    write = link._transmit
    error = PeerFailure(1, "lost by a test")

    def then_settled(frame, sock, flags=0):
        written = write(frame, sock, flags)
        if first == "acknowledged":  # as the reader would, meanwhile
            link._acknowledged(1)
        else:
            link.fail(error)
        return written

    link._transmit = then_settled
    done = _Counted()
    link.send(FrameHeader(Kind.DATA, 1, flags=ACK_NOW), memoryview(b"x"), done)
    assert done.settled == [None if first == "acknowledged" else error]


def test_a_healed_link_acknowledges_again_what_it_acknowledged_on_the_connection_that_dropped() -> None:
    old, old_theirs = _connected()
    new, new_theirs = _connected()
    link = PeerLink(owner=_Redialled(new), rank=1, sock=old, dialer=True, peer_port=0, heal_timeout=1.0)
    try:
        # Frame 1 is in, and its acknowledgement went out on the old connection after the peer had stopped
        # reading it: the peer replays frame 1, which we drop as one we have.
        link.received, link._acked_out = 1, 1
        link._heal(old, ConnectionResetError("reset by a test"))  # as the reader does
        link._outbox.put(None)
        link._send_loop()  # what the heal queued, on this thread

        def acknowledged(headers: list[FrameHeader]) -> bool:
            return any(header.kind == Kind.ACK and header.ack == 1 for header in headers)

        assert acknowledged(_headers_until(new_theirs, acknowledged))
    finally:
        for sock in (old, old_theirs, new, new_theirs):
            sock.close()


def test_a_frame_sent_after_the_goodbye_is_refused_not_left_waiting(link_and_peer) -> None:
    link, peer = link_and_peer
    goodbye, while_queued, after = SendTracker(), SendTracker(), SendTracker()
    link.finish(goodbye)
    link.send(FrameHeader(Kind.DATA, 1, flags=ACK_NOW), memoryview(b"x"), while_queued)
    link._send_loop()  # writes the goodbye and ends, on this thread: nothing is queued any more
    link.send(FrameHeader(Kind.DATA, 1, flags=ACK_NOW), memoryview(b"y"), after)  # not written here either
    for tracker in (while_queued, after):
        with pytest.raises(PeerFailure, match="closed its connection"):
            tracker.wait(time.monotonic() + 2, "a frame sent after the goodbye")
    assert [header.kind for header in _headers_until(peer, lambda headers: False)] == [Kind.BYE]
