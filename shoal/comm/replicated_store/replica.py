"""One replica of a job's store: the primary, which answers clients, or a follower, which keeps a copy.

The primary applies each change, then sends it to every follower and waits for each one's
acknowledgement (dropping a follower slower than `_ACK_S`) before it answers the client, so a change a
client has seen is held by every replica still following. It beats every `_BEAT_S` through the same
stream. A follower that loses its primary (the connection ends, or falls silent for `_SILENT_S`) looks
down the list of replicas: it follows the first that answers as the primary within `_SILENT_S`, and
takes over itself when every replica before it in the list is unreachable or not the primary. A
follower that joins receives the whole state first, and only from a store of the same id.

There is no majority vote: a follower cut off from a primary that still runs takes over too, and the
old primary goes on answering the clients that still reach it.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from typing import Any

from shoal.backoff import attempts
from shoal.comm.replicated_store import wire
from shoal.comm.replicated_store.state import CHANGES, StoreState

_BEAT_S = 0.5
_SILENT_S = 3.0  # a primary silent this long is lost to its followers
_ACK_S = 1.0  # a follower that takes longer to acknowledge is dropped: well within _SILENT_S, so the others stay
_CONNECT_S = 1.0


class StoreReplica:
    """A replica listening on `host:port` (0: any free port), reachable by others at `self.address`. It
    starts as the primary, or (`follow`: the address of any replica of the job) as a follower; then the
    constructor returns once it holds the state, and raises TimeoutError if no replica took it within
    `join_timeout` seconds (InterruptedError once `stop` is set)."""

    def __init__(self, host: str, port: int, *, follow: str | None = None, join_timeout: float = 60.0,
                 stop: threading.Event | None = None) -> None:
        self._listener = socket.create_server(("", port))  # every interface, as TCPStore's server; advertised as `host`
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._connections: set[socket.socket] = set()
        self._followers: dict[str, socket.socket] = {}
        self.is_primary = follow is None
        self._state = StoreState([self.address], store_id=secrets.token_hex(8) if follow is None else None)
        if follow is not None:
            try:
                upstream = self._join(follow, time.monotonic() + join_timeout, stop)
            except BaseException:
                self._listener.close()
                raise
            threading.Thread(target=self._follow, args=(upstream,), name="shoal-store-follow", daemon=True).start()
        else:
            self._start_beating()
        threading.Thread(target=self._accept, name="shoal-store-accept", daemon=True).start()

    @property
    def replicas(self) -> list[str]:
        with self._lock:
            return list(self._state.replicas)

    def close(self) -> None:
        """Stop serving: clients and followers find the next replica."""
        with self._lock:  # no change is answered from here on, so none is acknowledged unreplicated
            self._closed.set()
            self.is_primary = False
            sockets = [self._listener, *self._connections, *self._followers.values()]
            self._followers.clear()
            for sock in sockets:
                _close(sock)

    # ---- serving clients ----------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._closed.is_set():
                    _close(sock)
                    return
                self._connections.add(sock)
            threading.Thread(target=self._serve, args=(sock,), name="shoal-store-serve", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            while True:
                request = wire.receive(sock)
                if request["op"] == "follow":
                    if self._admit(request["address"], sock):
                        return  # the connection carries this follower's changes now
                    break
                wire.send(sock, self._answer(request))
        except (OSError, ValueError, KeyError, TypeError):  # gone, or not a client of ours: drop the connection
            pass
        with self._lock:
            self._connections.discard(sock)
        _close(sock)

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            reply: dict[str, Any] = {"primary": self.is_primary, "term": self._state.term,
                                     "store": self._state.store_id, "replicas": self._state.replicas}
            if request["op"] == "hello":
                return reply
            if not self.is_primary:
                return dict(reply, error="not the primary")
            if request["op"] in CHANGES:
                reply["result"] = self._state.apply(request)
                self._forward(request)
            else:
                reply["result"] = self._state.read(request)
            return reply

    # ---- the primary's side of replication ------------------------------------------------------------

    def _admit(self, address: str, sock: socket.socket) -> bool:
        """Take on `address` as a follower, sending it the state; False if this replica is not the primary."""
        with self._lock:
            if not self.is_primary:
                wire.send(sock, {"error": "not the primary", "replicas": self._state.replicas})
                return False
            self._connections.discard(sock)
            _close(self._followers.pop(address, None))  # it follows again: its old stream is dead
            if address not in self._state.replicas:
                self._change_replicas([*self._state.replicas, address])
            sock.settimeout(_ACK_S)
            try:
                wire.call(sock, {"snapshot": self._state.snapshot()})
            except (OSError, ValueError):
                _close(sock)
                self._change_replicas([r for r in self._state.replicas if r != address])
                return True
            self._followers[address] = sock
            return True

    def _forward(self, change: dict[str, Any]) -> None:
        """(Holding the lock.) Send `change` to every follower and wait for each; drop those that fail."""
        lost = []
        for address, sock in self._followers.items():
            try:
                wire.call(sock, {"apply": change})
            except (OSError, ValueError):
                lost.append(address)
        for address in lost:
            _close(self._followers.pop(address))
        if lost:
            self._change_replicas([r for r in self._state.replicas if r not in lost])

    def _change_replicas(self, replicas: list[str]) -> None:
        change = {"op": "replicas", "replicas": replicas}
        self._state.apply(change)
        self._forward(change)

    def _start_beating(self) -> None:
        def beat() -> None:
            while not self._closed.wait(_BEAT_S):
                with self._lock:
                    self._forward({"op": "beat"})
        threading.Thread(target=beat, name="shoal-store-beat", daemon=True).start()

    # ---- a follower's side -----------------------------------------------------------------------------

    def _join(self, address: str, deadline: float, stop: threading.Event | None) -> socket.socket:
        """Follow the primary, found from `address` (any replica), once it is up."""
        for _ in attempts(deadline, first=0.05, limit=0.5):
            if stop is not None and stop.is_set():
                raise InterruptedError(f"stopped while joining the job's store at {address}")
            upstream, replicas = self._try_follow(address)
            if upstream is not None:
                return upstream
            if replicas and replicas[0] != address:
                upstream, _ = self._try_follow(replicas[0])  # it named its primary
                if upstream is not None:
                    return upstream
        raise TimeoutError(f"no replica of the job's store at {address} took this one within the join timeout")

    def _try_follow(self, address: str) -> tuple[socket.socket | None, list[str]]:
        """A stream of `address`'s changes, after its state, if it is the primary; else None, and the
        replicas it names (none when it cannot be reached)."""
        try:
            sock = socket.create_connection(wire.split_address(address), timeout=_CONNECT_S)
        except OSError:
            return None, []
        try:
            sock.settimeout(_SILENT_S)
            reply = wire.call(sock, {"op": "follow", "address": self.address})
            if "snapshot" not in reply:
                _close(sock)
                return None, reply.get("replicas", [])
            with self._lock:
                theirs = reply["snapshot"]
                if self._state.store_id not in (None, theirs["store"]) or theirs["term"] < self._state.term:
                    _close(sock)  # another job's store on a reused address, or a replica behind this one
                    return None, []
                self._state = StoreState.restore(theirs)
            wire.send(sock, {"ack": 1})
            return sock, []
        except (OSError, ValueError, KeyError, TypeError):
            _close(sock)
            return None, []

    def _follow(self, upstream: socket.socket) -> None:
        while not self._closed.is_set():
            with self._lock:
                self._connections.add(upstream)
            try:
                while True:
                    change = wire.receive(upstream)["apply"]
                    with self._lock:
                        self._state.apply(change)
                    wire.send(upstream, {"ack": 1})
            except (OSError, ValueError, KeyError, TypeError):
                pass
            with self._lock:
                self._connections.discard(upstream)
            _close(upstream)
            if self._closed.is_set():
                return
            upstream = self._next_primary()
            if upstream is None or self._closed.is_set():
                _close(upstream)
                return

    def _next_primary(self) -> socket.socket | None:
        """Follow the first replica of the list that is alive and the primary (the one lost may have dropped
        this follower only, or another may have taken over); take over (None) when every replica before
        this one is gone."""
        with self._lock:
            candidates = list(self._state.replicas)
        lost: set[str] = set()
        for address in candidates:
            if address == self.address:
                self._take_over(lost)
                return None
            deadline = time.monotonic() + _SILENT_S
            for _ in attempts(deadline, first=0.02, limit=0.2):
                if self._closed.is_set():
                    return None
                upstream, replicas = self._try_follow(address)
                if upstream is not None:
                    return upstream
                if not replicas:  # unreachable: gone with its machine or process
                    break
            lost.add(address)
        return None  # not among the replicas any more (the primary dropped it): nothing to follow or serve

    def _take_over(self, lost: set[str]) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            self.is_primary = True
            self._state.term += 1
            self._state.replicas = [self.address] + [r for r in self._state.replicas
                                                     if r not in lost and r != self.address]
        self._start_beating()


def _close(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
