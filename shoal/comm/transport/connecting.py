"""How a transport's connections come up: each rank dials every lower rank and is dialled by every higher one
(a rank joining a running group dials every member), both ends authenticate and resume (healing.py), and
the connection becomes a `PeerLink`; a dropped one is dialled again by the same end."""

from __future__ import annotations

import errno
import logging
import math
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from shoal.backoff import attempts
from shoal.comm.transport import auth
from shoal.comm.transport.healing import StreamsDisagree, process_gone, resume_as_dialled, resume_as_dialler
from shoal.comm.transport.link import PeerLink
from shoal.comm.transport.matching import Matcher
from shoal.errors import PeerFailure

log = logging.getLogger(__name__)

_HANDSHAKE_TIMEOUT_S = 10.0
# One connection attempt gives up after this and the next begins: a SYN lost while the network was down
# is otherwise sent again only after 1, 3, 7... s, long after the network is back.
_CONNECT_ATTEMPT_S = 1.0
_ADOPT_WAIT_S = 5.0  # a joiner's connection, accepted, is adopted by its handshake thread within this
# A dropped connection that cannot be made again between its own two addresses for this long (or a third of the
# time left, if less) is tried between the pair's other addresses in turn: their network may be down for good.
_FAILOVER_AFTER_S = 3.0
_HOME_CHECK_MAX_S = 30.0  # the longest wait between checks that a failed-over connection's own network is back


class Connecting:
    """The connection set-up of `Transport` (mesh.py), which holds the state declared here and sets it up."""

    rank: int
    world_size: int
    hosts: tuple[str, ...]
    address: tuple[str, int]  # (our hosts joined by commas, the port we listen on at each): what peers dial
    closed: bool
    _open: bool
    _stall_timeout: timedelta
    _heal_timeout: float
    _secret: bytes
    _session: bytes
    _lock: threading.Lock
    _links: dict[tuple[int, int], PeerLink]  # (peer, stream) -> its connection
    _dialled: dict[int, tuple[str, int]]  # each peer we dial -> the address it published: (its hosts joined by
    # commas, its port)
    # (peer, stream) of each connection on another network than its own -> (when to check next whether its own
    # is back, how long to wait after that check)
    _homing: dict[tuple[int, int], tuple[float, float]]
    _streams: int
    _refused: dict[int, str]  # peers refused for keeping another number of connections, and why
    _links_changed: threading.Condition
    _matcher: Matcher
    _listeners: list[socket.socket]
    _start: Callable[..., None]
    link_lost: Callable[[int, str], PeerFailure]

    def check_addresses(self, published: dict[int, str]) -> None:
        """ValueError unless every peer listens on as many addresses as we do (`published`: each peer's, joined
        by commas), so that each of a pair's connections joins an address of ours to one of theirs on the same
        network."""
        ours = len(self.hosts)
        others = {rank: n for rank, text in published.items() if (n := len(text.split(","))) != ours}
        if others:
            raise ValueError(f"rank {self.rank} listens on {ours} address(es) (SHOAL_SOCKET_IFNAME), but "
                             + ", ".join(f"rank {rank} on {n}" for rank, n in sorted(others.items()))
                             + ": every rank must name as many interfaces, one on each network")

    def connect_mesh(self, addresses: dict[int, tuple[str, int]], timeout: timedelta) -> None:
        """Connect to every lower rank and wait for every higher rank to connect to us."""
        deadline = time.monotonic() + timeout.total_seconds()
        for peer in range(self.rank):
            self._dialled[peer] = address = (addresses[peer][0], addresses[peer][1])
            for stream in range(self._streams):
                sock, _ = self._dial(peer, address, deadline, stream=stream)
                self._adopt(peer, stream, sock, address[1])
        with self._lock:
            missing = lambda: sorted({r for r in range(self.rank + 1, self.world_size)  # noqa: E731
                                      for s in range(self._streams) if (r, s) not in self._links})
            # Done once every rank is in, or every one still missing was refused (it will not try again).
            self._links_changed.wait_for(lambda: all(r in self._refused for r in missing()),
                                         timeout=max(0.0, deadline - time.monotonic()))
            late = missing()
            if late:
                refused = "".join(f"; rank {r}'s connection was refused: {self._refused[r]}"
                                  for r in late if r in self._refused)
                if all(r in self._refused for r in late):
                    raise ValueError(f"rank {self.rank}: ranks {late} could not connect{refused}")
                raise TimeoutError(f"rank {self.rank}: ranks {late} did not connect within "
                                   f"{timeout.total_seconds():g}s{refused}")

    def dial_member(self, peer: int, address: tuple[str, int], timeout: timedelta) -> None:
        """As a rank that joins a running group: connect to member `peer`. One that is gone (its
        listener refuses) is recorded as lost, as a peer lost later would be; TimeoutError if it is
        not reached within `timeout` (it may live: the join fails, rather than go on without it)."""
        self.check_addresses({peer: address[0]})
        self._dialled[peer] = address
        deadline = time.monotonic() + timeout.total_seconds()
        for stream in range(self._streams):
            try:
                sock, _ = self._dial(peer, address, deadline, stream=stream, refused_is_final=True)
            except PeerFailure as exc:
                self.link_lost(peer, f"it was gone when rank {self.rank} joined ({exc.detail})")
                return
            self._adopt(peer, stream, sock, address[1])

    def _dial(self, peer: int, address: tuple[str, int], deadline: float, *, stream: int, received: int = 0,
              refused_is_final: bool = False, failover: bool = False) -> tuple[socket.socket, int]:
        """An authenticated connection `stream` to `peer` at `address` (its hosts joined by commas, and its
        port), and the last frame it says it received from us on it; with `failover`, between another pair of
        our and its addresses if not between its own soon (_FAILOVER_AFTER_S)."""
        hosts = address[0].split(",")
        turn_at = time.monotonic() + min(_FAILOVER_AFTER_S, (deadline - time.monotonic()) / 3)
        error: OSError | None = None
        pair = stream
        for _ in attempts(deadline):  # the peer's listener may not be up yet, or the network may be down
            if failover and len(hosts) > 1 and time.monotonic() >= turn_at:
                pair += 1
                log.warning("rank %d: connection %d to rank %d cannot be made on its own network; trying %s",
                            self.rank, stream, peer, hosts[pair % len(hosts)])
            target = (hosts[pair % len(hosts)], address[1])
            try:
                # From one of our listeners' addresses: the peer takes the connection's source for ours, and
                # probes it while it waits for us to dial again (healing.py), which another interface's would fail.
                sock = socket.create_connection(target, timeout=min(_CONNECT_ATTEMPT_S,
                                                                    max(0.1, deadline - time.monotonic())),
                                                source_address=(self.hosts[pair % len(self.hosts)], 0))
                try:
                    sock.settimeout(min(_HANDSHAKE_TIMEOUT_S, max(0.1, deadline - time.monotonic())))
                    auth.client_handshake(sock, self._secret, self._session, my_rank=self.rank, peer_rank=peer)
                    peer_received, _ = resume_as_dialler(sock, peer, stream, self._streams, received,
                                                         self.address[1])
                    _configure(sock, self._stall_timeout)
                except BaseException:
                    sock.close()
                    raise
                return sock, peer_received
            except auth.AuthenticationError as exc:
                if not refused_is_final:
                    raise
                raise PeerFailure(peer, f"it refused to reconnect ({exc})") from None
            except ConnectionRefusedError as exc:
                if refused_is_final:
                    raise process_gone(peer) from None
                error = exc
            except OSError as exc:
                error = exc
        where = f"{', '.join(hosts)} port {address[1]}, from {', '.join(self.hosts)}"
        if len(self.hosts) > 1:
            where += (" (does SHOAL_SOCKET_IFNAME name the interfaces in the same order on every host, one on each "
                      "network?)")
        raise TimeoutError(f"rank {self.rank} could not connect to rank {peer} at {where}: {error}")

    def redial(self, link: PeerLink, address: tuple[str, int], deadline: float) -> tuple[socket.socket, int]:
        """`link`'s connection dialled again: at the address it had, or at any the peer published."""
        return self._dial(link.rank, self._dialled.get(link.rank, address), deadline, stream=link.stream,
                          received=link.received, refused_is_final=True, failover=True)

    def move_home(self, links: list[PeerLink], interval: float) -> None:
        """For each connection we dialled that failed over to another network, check (on a thread of its own)
        whether its own network joins us to the peer again, and move it back if so: a pair's networks each
        carry their share of its bytes again. A connection's checks come `interval` apart at first, and twice
        as far apart after each, up to _HOME_CHECK_MAX_S, until it is seen on its own network again."""
        if len(self.hosts) == 1 or self.closed:
            return
        now = time.monotonic()
        for link in links:
            key, ours = (link.rank, link.stream), self.hosts[link.stream % len(self.hosts)]
            where, published = link.local_host(), self._dialled.get(link.rank)
            if not link.dialer or published is None or where is None:
                continue  # dialled by the peer, or broken: it heals on its own
            with self._lock:
                if where == ours or link.ended:
                    self._homing.pop(key, None)
                    continue
                due, wait = self._homing.get(key, (now, interval))
                if now < due:
                    continue
                self._homing[key] = (math.inf, wait)  # one check at a time
            theirs = published[0].split(",")
            try:
                self._start(self._check_home, link, (theirs[link.stream % len(theirs)], published[1]), ours, wait,
                            name="shoal-home")
            except RuntimeError:  # no thread to be had: the next heartbeat tries again
                with self._lock:
                    self._homing[key] = (now, wait)
                raise

    def _check_home(self, link: PeerLink, theirs: tuple[str, int], ours: str, wait: float) -> None:
        """Move `link` back to the network between `ours` and `theirs` if a bare connection goes through there:
        it leaves the working connection alone, and the peer's listener takes it for a check that it lives. The
        next check is `wait` later, so that a network which takes a connection but not the link's own dial
        (healing.py) costs the link a heal that often at most."""
        try:
            with socket.create_connection(theirs, timeout=_CONNECT_ATTEMPT_S, source_address=(ours, 0)):
                back = True
        except OSError:
            back = False  # still down
        with self._lock:
            key = (link.rank, link.stream)
            if key in self._homing:  # else seen on its own network meanwhile
                self._homing[key] = (time.monotonic() + wait, min(2 * wait, _HOME_CHECK_MAX_S))
        if back and not self.closed:
            link.go_home(ours)

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # listener closed
            self._start(self._admit, conn, name="shoal-handshake")

    def _admit(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(_HANDSHAKE_TIMEOUT_S)
            peer = auth.server_handshake(conn, self._secret, self._session, my_rank=self.rank,
                                         world_size=None if self._open else self.world_size,
                                         admit=self._check_newcomer)

            def received_on(stream: int) -> int:
                link = self._links.get((peer, stream))
                return link.received if link else 0
            peer_received, peer_port, stream = resume_as_dialled(conn, peer, self._streams, received_on,
                                                                   self.address[1])
            _configure(conn, self._stall_timeout)
            link = self._links.get((peer, stream))
            if link is None:
                self._adopt(peer, stream, conn, peer_port)
            else:
                link.replace(conn, peer_received)
        except auth.HandshakeAbandoned:
            conn.close()  # a peer checking that we are alive, or one that gave up
        except (OSError, struct.error, ValueError) as exc:
            log.warning("rank %d rejected a connection: %s", self.rank, exc)
            conn.close()
            if isinstance(exc, StreamsDisagree):  # raised once the peer is known
                with self._lock:
                    self._refused[peer] = str(exc)
                    self._links_changed.notify_all()

    def _check_newcomer(self, peer: int) -> None:
        if peer < self.rank and not self._open:  # with open membership, a joiner dials every member
            raise auth.AuthenticationError(f"rank {peer} should be dialled, not dial in")
        with self._lock:
            if self.closed:
                raise auth.AuthenticationError(f"rank {self.rank} is closing")
            if (failure := self._matcher.failure(peer)) is not None:
                raise auth.AuthenticationError(f"rank {peer} was given up: {failure}")

    def _adopt(self, peer: int, stream: int, sock: socket.socket, peer_port: int) -> None:
        link = PeerLink(self, peer, sock, dialer=peer < self.rank, peer_port=peer_port,
                        heal_timeout=self._heal_timeout, stream=stream)
        with self._lock:
            if (peer, stream) in self._links or self.closed:
                raise auth.AuthenticationError(f"rank {peer} is already connected")
            self._links[peer, stream] = link
            self._links_changed.notify_all()
        link.start(self._start)

    def _link(self, dst: int, stream: int = 0) -> PeerLink:
        """Connection `stream` to `dst`. A rank that has just joined may be known (through the store) a
        moment before its connection here is adopted: that is waited for, briefly."""
        key = (dst, stream)
        link = self._links.get(key)
        if link is None:
            with self._lock:
                self._links_changed.wait_for(lambda: key in self._links or self.closed, timeout=_ADOPT_WAIT_S)
                link = self._links.get(key)
            if link is None:
                raise PeerFailure(dst, f"rank {self.rank} has no connection to it")
        return link

    def _streams_to(self, rank: int) -> list[PeerLink]:
        """Every connection to `rank` there is."""
        return [link for s in range(self._streams) if (link := self._links.get((rank, s))) is not None]


_PORT_TRIES = 10


def listen(hosts: tuple[str, ...], backlog: int) -> list[socket.socket]:
    """A listener on each of `hosts`, all on one port: a peer knows our port once, and dials or probes it at
    whichever of our addresses its connection came from. A free port on the first may be taken on another; then
    another port is tried."""
    for _ in range(_PORT_TRIES):
        listeners = [socket.create_server((hosts[0], 0), backlog=backlog)]
        port = listeners[0].getsockname()[1]
        try:
            for host in hosts[1:]:
                listeners.append(socket.create_server((host, port), backlog=backlog))
            return listeners
        except BaseException as exc:
            for listener in listeners:
                listener.close()
            if not isinstance(exc, OSError) or exc.errno != errno.EADDRINUSE:
                raise
    raise OSError(errno.EADDRINUSE, f"no port was free on all of {', '.join(hosts)} in {_PORT_TRIES} tries")


def _configure(sock: socket.socket, stall_timeout: timedelta) -> None:
    sock.settimeout(None)
    # A write that makes no progress for this long means the peer has stopped reading (stalled,
    # not dead): fail it rather than block a thread forever.
    seconds = stall_timeout.total_seconds()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(seconds), int((seconds % 1) * 1e6)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # The buffers' sizes are left to the kernel, which grows them with the connection's rate and round trip:
    # a size set here would switch that off and cap the connection at size / round trip.
