"""A frame the sender asked to have acknowledged at once is, whichever writer holds the link when it
arrives: the sender's operation waits for that acknowledgement, so one left lying costs it until our
next write, up to a heartbeat interval later."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from shoal.comm.transport.frame_header import SIZE, FrameHeader, Kind
from shoal.comm.transport.link import PeerLink


@pytest.fixture
def link_and_peer() -> Iterator[tuple[PeerLink, socket.socket]]:
    """A link (no threads started) over a real TCP connection, and the peer's end of it."""
    listener = socket.create_server(("127.0.0.1", 0))
    ours = socket.create_connection(listener.getsockname())
    theirs, _ = listener.accept()
    listener.close()
    link = PeerLink(owner=None, rank=1, sock=ours, dialer=False, peer_port=0, heal_timeout=1.0)
    try:
        yield link, theirs
    finally:
        ours.close()
        theirs.close()


def _headers_written(peer: socket.socket) -> list[FrameHeader]:
    """Every frame header the link has written so far (they carry no payload here)."""
    data = bytearray()
    while True:
        try:
            chunk = peer.recv(1 << 16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
        data += chunk
    return [FrameHeader.unpack(data[i:i + SIZE]) for i in range(0, len(data), SIZE)]


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
    link.heartbeat(time.monotonic(), interval=1.0, timeout=100.0)

    headers = _headers_written(peer)
    assert headers[0].kind == Kind.HEARTBEAT and headers[0].ack == 0
    assert max(header.ack for header in headers) == 1, f"frame 1 was never acknowledged: {headers}"
