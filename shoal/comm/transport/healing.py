"""How a link survives the loss of its TCP connection while both processes live: the higher rank dials again,
both sides authenticate and tell each other the last frame they received (`resume_as_dialler`,
`resume_as_dialled`), and the sender replays the rest of its window; the receiver drops any frame it already
has, so every frame is delivered exactly once and in order. A peer whose listener refuses connections is
gone, not healing."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from shoal.comm.transport.frame_header import recv_exact
from shoal.errors import PeerFailure
from shoal.observe import events

if TYPE_CHECKING:
    from shoal.comm.transport.link import LinkOwner

log = logging.getLogger(__name__)

# Sent by both ends of a new connection, after authenticating: the last frame number each has received on it,
# the port its listener is on (where the other end dials, or probes whether this process lives), which of
# the pair's connections it is, and how many each rank opens to each other rank.
_RESUME = struct.Struct("<QHBB")


class StreamsDisagree(ValueError):
    """The two ends of a new connection keep different numbers of connections per pair: it cannot resume."""


def resume_as_dialler(sock: socket.socket, peer: int, stream: int, streams: int, received: int,
                      listen_port: int) -> tuple[int, int]:
    """Resume connection `stream` of our `streams` to rank `peer` on a freshly authenticated socket that we
    dialled: (the last frame the peer received on it, its listener's port)."""
    sock.sendall(_RESUME.pack(received, listen_port, stream, streams))
    peer_received, peer_port, _, peer_streams = _read_resume(sock)
    _agree(streams, peer, peer_streams)
    return peer_received, peer_port


def resume_as_dialled(sock: socket.socket, peer: int, streams: int, received_on: Callable[[int], int],
                      listen_port: int) -> tuple[int, int, int]:
    """Resume a connection rank `peer` dialled to us: (the last frame it received on it, its listener's port,
    which of the pair's connections it is); `received_on(stream)` is our last frame received on that one."""
    peer_received, peer_port, stream, peer_streams = _read_resume(sock)
    valid = stream < peer_streams == streams
    sock.sendall(_RESUME.pack(received_on(stream) if valid else 0, listen_port, stream, streams))
    _agree(streams, peer, peer_streams)
    if not valid:
        raise StreamsDisagree(f"rank {peer} resumed connection {stream} of {peer_streams}")
    return peer_received, peer_port, stream


def _read_resume(sock: socket.socket) -> tuple[int, int, int, int]:
    reply = bytearray(_RESUME.size)
    recv_exact(sock, memoryview(reply))
    return _RESUME.unpack(reply)


def _agree(ours: int, peer: int, theirs: int) -> None:
    if ours != theirs:
        raise StreamsDisagree(f"this rank keeps {ours} connection(s) to each other rank, and rank {peer} keeps "
                              f"{theirs}: SHOAL_STREAMS must be the same on every rank")


class Healing:
    """The healing of `PeerLink` (link.py), which holds the state declared here and sets it up."""

    rank: int
    stream: int
    _owner: LinkOwner
    last_heard: float
    _sock: socket.socket
    dialer: bool
    _address: tuple[str, int]
    _heal_timeout: float
    _state: threading.Lock
    _state_changed: threading.Condition
    _broken: bool
    _replay_due: bool
    _reacknowledge: bool
    _replacement: tuple[socket.socket, int] | None
    _dropped: tuple[str, float] | None
    _retired: list[socket.socket]
    _gone: PeerFailure | None

    def _break(self, sock: socket.socket, exc: OSError) -> None:
        """A write on `sock` failed: frames wait in the window; the reader, woken here, heals the link."""
        with self._state:
            if sock is not self._sock:
                return  # an old connection, already replaced
            self._broken = True
        log.info("connection to rank %d broke while writing (%s); healing", self.rank, exc)
        shut(sock)

    def drop(self, why: str, silent_s: float) -> None:
        """Give the current connection up (it `why`: nothing came on it for `silent_s`) and heal it, as if it
        had dropped. The heal has `silent_s` more than its deadline: the peer, which dials again if we do
        not, may find the silence up to that much later than we did."""
        self._give_up(why, silent_s, lambda: time.monotonic() - self.last_heard > silent_s)  # unless heard since

    def go_home(self, home: str) -> None:
        """Give up the current connection, made from another of our addresses when the network of `home`, its
        own, was down, for one from `home`, which is back: healed as if it had dropped, and dialled from `home`
        first."""
        self._give_up(f"moves back to its own network (connection {self.stream}, from our {home})", 0.0,
                      lambda: self.local_host() not in (None, home), logging.WARNING)

    def local_host(self) -> str | None:
        """Our address the current connection is from; None if it is broken."""
        try:
            return None if self._broken else self._sock.getsockname()[0]
        except OSError:
            return None

    def _give_up(self, why: str, grace: float, still_wanted: Callable[[], bool], level: int = logging.INFO) -> None:
        """Shut the current connection for the reader to heal, with `grace` added to the heal's deadline, unless
        it broke or was given up since the caller looked, the transport is closing, or it is no longer
        `still_wanted`."""
        with self._state:
            if self._broken or self._gone is not None or self._owner.closed or not still_wanted():
                return
            self._broken = True
            self._dropped = (why, grace)
            current = self._sock
        log.log(level, "connection to rank %d %s; healing", self.rank, why)
        shut(current)  # the reader, woken, heals it

    def replace(self, sock: socket.socket, peer_received: int) -> None:
        """The peer dialled us again (it found the connection broken first, or so did we), maybe over another
        of our networks: its process is probed there from now on."""
        host = sock.getpeername()[0]  # OSError if it is gone already; the peer then dials again
        with self._state:
            if self._gone is not None:
                sock.close()
                return
            old, self._replacement = self._replacement, (sock, peer_received)
            self._address = (host, self._address[1])
            current = self._sock
            self._broken = True
            self._state_changed.notify_all()
        if old is not None:
            old[0].close()
        shut(current)  # the reader, if still on it, moves to the new connection

    def _heal(self, sock: socket.socket, exc: OSError) -> None:
        """Replace a dropped connection (reader thread): dial again or wait to be dialled, until the
        heal deadline; PeerFailure (after telling the owner) when the peer's process is gone or the
        deadline passes."""
        with self._state:
            self._broken = True
            self._retired.append(sock)
            dropped, self._dropped = self._dropped, None
        shut(sock)
        cause, grace = dropped or (str(exc), 0.0)
        log.info("connection to rank %d dropped (%s); healing", self.rank, cause)
        healing = events.begin()
        deadline = time.monotonic() + self._heal_timeout + grace
        try:
            new, peer_received = (self._owner.redial(self, self._address, deadline) if self.dialer
                                  else self._await_redial(deadline))
        except PeerFailure as failure:
            raise self._owner.link_lost(self.rank, failure.detail) from None
        except TimeoutError:
            raise self._owner.link_lost(self.rank, f"the connection dropped ({cause}) and could not be restored "
                                                   f"within {self._heal_timeout + grace:g}s") from None
        self._acknowledged(peer_received)
        with self._state:
            if self._gone is not None or self._owner.closed:  # given up or closed while we healed
                new.close()
                raise self._gone or PeerFailure(self.rank, "the transport closed while the link healed")
            self._sock, self._broken = new, False
            self._replay_due = bool(self._window)
            # Our last acknowledgement may have gone out on the old connection after the peer stopped reading
            # it; the peer then replays a frame we have, which we drop, and would wait for our next write.
            self._reacknowledge = True
            self.last_heard = time.monotonic()
        self._enqueue(None, memoryview(b""), None)  # the send thread replays (never the reader: see send)
        log.info("connection to rank %d restored", self.rank)
        events.complete(f"link to rank {self.rank} healed", events.FAULT, healing, peer=self.rank, cause=cause,
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


def shut(sock: socket.socket) -> None:
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
