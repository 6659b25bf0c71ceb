"""Authenticated peer-to-peer byte transport: one TCP connection per pair of ranks, frames received
straight into buffers the receiver posted in advance (zero-copy), unexpected frames held aside."""

from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from shoal.comm import auth, shm
from shoal.comm.frames import (
    ABORT,
    BYE,
    DATA,
    HEADER,
    NO_SLOT,
    SHM_ACCEPT,
    SHM_OFFER,
    Held,
    Op,
    Payload,
    Recv,
    SendTracker,
    Signature,
    recv_exact,
    send_frame,
)
from shoal.errors import CollectiveMismatchError, GroupBrokenError, PeerFailure

log = logging.getLogger(__name__)

_MAX_ABORT_TEXT = 1 << 16
_HANDSHAKE_TIMEOUT_S = 10.0
_SOCKET_BUFFER = 4 << 20
# Frames up to this size are written by the calling thread when nothing is queued for the peer:
# a thread hand-off costs more than the copy. Reader threads never write inline (see `send`).
_INLINE_BYTES = 64 << 10
# How long close() reads on for the goodbyes of peers closing at the same time, before it stops
# reading the rest: reading them out spares those peers a connection reset.
_DRAIN_S = 1.0
_on_reader_thread = threading.local()

# handler(src, tag, seq, sub, nbytes, payload): takes one frame of a group served by a handler. It runs
# on the reader thread and must read the payload (a frames.Payload) before it returns.
FrameHandler = Callable[[int, int, int, int, int, Payload], None]


class _Peer:
    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.queued = 0  # frames put in the outbox and not yet written; guarded by count_lock
        self.count_lock = threading.Lock()
        self.write_lock = threading.Lock()  # one writer at a time: the send thread or an inline sender
        self.lane_out: shm.Outbound | None = None
        self.lane_in: shm.Inbound | None = None

    def enqueue(self, item: tuple) -> None:
        with self.count_lock:
            self.queued += 1
        self.outbox.put(item)


class Transport:
    """Full mesh of authenticated connections between the ranks of one job."""

    def __init__(self, rank: int, world_size: int, *, secret: bytes, session: bytes, host: str,
                 stall_timeout: timedelta) -> None:
        self.rank, self.world_size = rank, world_size
        self._stall_timeout = stall_timeout
        self._secret, self._session = secret, session
        self._lock = threading.Lock()
        self._peers: dict[int, _Peer] = {}
        self._peers_changed = threading.Condition(self._lock)
        self._posted: dict[tuple, Recv] = {}
        self._held: dict[tuple, Held] = {}
        self._active: dict[tuple[int, int, int], Op] = {}
        self._aborted: dict[tuple[int, int, int], BaseException] = {}
        self._lost: dict[int, PeerFailure] = {}  # crashed: every op they take part in fails
        self._departed: dict[int, PeerFailure] = {}  # said goodbye after their last frame
        self._handlers: dict[int, FrameHandler] = {}
        self._failure_listeners: list[Callable[[PeerFailure], None]] = []
        self._closed = False
        # Every thread we start, so that close() can join them: a thread still running (or ending)
        # while the interpreter finalizes can abort the process inside torch's thread-local cleanup.
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server((host, 0), backlog=max(16, world_size))
        self.address = self._listener.getsockname()[:2]
        self._start(self._accept_loop, name="shoal-accept")

    # ---- connection set-up -------------------------------------------------------------------

    def connect_mesh(self, addresses: dict[int, tuple[str, int]], timeout: timedelta) -> None:
        """Connect to every lower rank and wait for every higher rank to connect to us."""
        deadline = time.monotonic() + timeout.total_seconds()
        for peer in range(self.rank):
            self._adopt(peer, self._dial(peer, tuple(addresses[peer]), deadline))
        with self._lock:
            missing = lambda: [r for r in range(self.rank + 1, self.world_size) if r not in self._peers]  # noqa: E731
            if not self._peers_changed.wait_for(lambda: not missing(),
                                                timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"rank {self.rank}: ranks {missing()} did not connect within "
                                   f"{timeout.total_seconds():g}s")

    def _dial(self, peer: int, address: tuple[str, int], deadline: float) -> socket.socket:
        delay = 0.01
        while True:
            try:
                sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
                sock.settimeout(min(_HANDSHAKE_TIMEOUT_S, max(0.1, deadline - time.monotonic())))
                auth.client_handshake(sock, self._secret, self._session, my_rank=self.rank, peer_rank=peer)
                return sock
            except auth.AuthenticationError:
                raise
            except OSError as exc:
                if time.monotonic() + delay > deadline:
                    raise TimeoutError(f"rank {self.rank} could not connect to rank {peer} at "
                                       f"{address[0]}:{address[1]}: {exc}") from None
                time.sleep(delay)  # retry backoff for a listener that is not accepting yet
                delay = min(2 * delay, 0.5)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener closed
            self._start(self._admit, conn, name="shoal-handshake")

    def _admit(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(_HANDSHAKE_TIMEOUT_S)
            peer = auth.server_handshake(conn, self._secret, self._session, my_rank=self.rank,
                                         world_size=self.world_size, admit=self._check_newcomer)
            self._adopt(peer, conn)
        except (OSError, struct.error, ValueError) as exc:
            log.warning("rank %d rejected a connection: %s", self.rank, exc)
            conn.close()

    def _check_newcomer(self, peer: int) -> None:
        if peer < self.rank:
            raise auth.AuthenticationError(f"rank {peer} should be dialled, not dial in")
        with self._lock:
            if peer in self._peers or self._closed:
                raise auth.AuthenticationError(f"rank {peer} is already connected")

    def _adopt(self, peer_rank: int, sock: socket.socket) -> None:
        sock.settimeout(None)
        # A write that makes no progress for this long means the peer has stopped reading (stalled,
        # not dead): fail it rather than block a thread forever.
        seconds = self._stall_timeout.total_seconds()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", int(seconds), int((seconds % 1) * 1e6)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
        peer = _Peer(peer_rank, sock)
        with self._lock:
            if peer_rank in self._peers or self._closed:
                raise auth.AuthenticationError(f"rank {peer_rank} is already connected")
            self._peers[peer_rank] = peer
            self._peers_changed.notify_all()
        self._start(self._read_loop, peer, name=f"shoal-read-{peer_rank}")
        if shm.available():
            peer.lane_out = shm.Outbound()
            name = peer.lane_out.name.encode()
            peer.enqueue((HEADER.pack(SHM_OFFER, 0, 0, 0, 0, 0, 0, 0, 0, 0, len(name), NO_SLOT),
                          memoryview(name), None))
        self._start(self._send_loop, peer, name=f"shoal-send-{peer_rank}")

    def _start(self, target: Callable[..., None], *args: object, name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def serve(self, group: int, handler: FrameHandler) -> None:
        """Hand every frame of `group` to `handler` instead of matching it to posted receives: for
        messages nobody posted a receive for in advance (RPC requests)."""
        self._handlers[group] = handler

    def on_peer_failure(self, listener: Callable[[PeerFailure], None]) -> None:
        """Call `listener` once for each peer that crashes or leaves, on the thread that noticed."""
        self._failure_listeners.append(listener)

    # ---- operations --------------------------------------------------------------------------

    def begin(self, op: Op) -> None:
        """Register a collective so that frames disagreeing with it are caught as they arrive."""
        with self._lock:
            self._check_usable(op)
            self._active[op.ident] = op

    def end(self, op: Op) -> None:
        """Forget an operation; receives still posted for it (after a failure) are withdrawn."""
        with self._lock:
            op.cancelled = op.cancelled or GroupBrokenError(f"{op.name} has ended")
            self._active.pop(op.ident, None)
            for key in [k for k, r in self._posted.items() if r.op is op]:
                del self._posted[key]
            for key in [k for k in self._held if k[1:4] == op.ident]:
                del self._held[key]

    def post_recv(self, op: Op, src: int, sub: int, view: memoryview, *,
                  process: Callable[[], None] | None = None,
                  on_done: Callable[[Recv], None] | None = None) -> Recv:
        """Post the receive of frame (src, op, sub) into `view`, so it lands there without a copy."""
        recv = Recv(op, src, sub, view, process, on_done)
        key = (src, *op.ident, sub)
        with self._lock:
            held = self._held.get(key)
            if held is not None and held.complete:
                del self._held[key]  # a frame that arrived is delivered, even if its sender has left since
            else:
                self._check_usable(op, src)
                if held is None:
                    self._posted[key] = recv
                else:
                    held.waiter = recv  # the reader thread hands it over when the frame is in
                return recv
        self._deliver_held(recv, held)
        return recv

    def send(self, op: Op, dst: int, sub: int, payload: memoryview, tracker: SendTracker, *,
             eager: bool = False) -> None:
        """Send frame (op, sub) to `dst` without waiting; `tracker` learns when `payload` may be reused.

        `eager` lets the calling thread write a large frame itself when the peer's queue is idle, as
        it does small ones: right for a caller that waits for the answer anyway (RPC), wrong for one
        that has other frames to post meanwhile (the ring algorithms).
        """
        with self._lock:
            self._check_usable(op, dst)
            peer = self._peers[dst]
        header = (DATA, op.sig[1], op.sig[0], op.sig[2], op.sig[3], op.group, op.tag, op.seq, sub, op.sig[4],
                  len(payload))
        tracker.add()
        # Inline only when nothing is queued (order is kept) and not from a reader thread: a reader
        # blocked in a write could stop draining its socket while the peer's reader does the same.
        if ((eager or len(payload) <= _INLINE_BYTES) and not getattr(_on_reader_thread, "active", False)
                and peer.write_lock.acquire(blocking=False)):
            try:
                with peer.count_lock:
                    idle = peer.queued == 0
                if idle:
                    error = None
                    try:
                        self._write(peer, header, payload)
                    except OSError as exc:
                        error = self._send_failed(dst, exc)
                    tracker.settle(error)
                    return
            finally:
                peer.write_lock.release()
        peer.enqueue((header, payload, tracker))

    def wait(self, recv: Recv) -> None:
        """Block until `recv` is in (and processed), or its op's deadline passes."""
        op = recv.op
        if not recv.event.wait(max(0.0, op.deadline - time.monotonic())):
            raise TimeoutError(f"{op.name} on rank {self.rank}: nothing from rank {recv.src} within "
                               f"{op.timeout.total_seconds():g}s (is it alive but not calling {op.name}?)")
        if recv.error is not None:
            raise recv.error

    def abort(self, op: Op, error: BaseException) -> None:
        """Fail `op` here and on every other rank taking part, so no one waits for it in vain."""
        text = str(error).encode()[:_MAX_ABORT_TEXT]
        header = (ABORT, 0, 0, 0, 0, op.group, op.tag, op.seq, 0, 0, len(text))
        with self._lock:
            peers = [self._peers[r] for r in op.ranks if r in self._peers and r not in self._lost]
        for peer in peers:
            peer.enqueue((header, memoryview(text), None))
        self._fail_op(op.ident, error)

    def _check_usable(self, op: Op, peer: int | None = None) -> None:
        """Raise if `op` cannot proceed: closed, aborted, a member crashed, or `peer` has left."""
        if self._closed:
            raise GroupBrokenError(f"rank {self.rank}: the transport is closed")
        if op.ident in self._aborted:
            raise self._aborted[op.ident]
        for rank in (op.ranks if peer is None else (peer, *op.ranks)):
            if rank in self._lost:
                raise self._lost[rank]
        if peer in self._departed:  # only the peer itself: others may finish what it took part in
            raise self._departed[peer]

    # ---- background threads ------------------------------------------------------------------

    def _send_loop(self, peer: _Peer) -> None:
        while True:
            item = peer.outbox.get()
            if item is None:
                return
            header, payload, tracker = item
            error = self._lost.get(peer.rank)
            if error is None:
                try:
                    with peer.write_lock:
                        if isinstance(header, tuple):
                            self._write(peer, header, payload)
                        else:
                            send_frame(peer.sock, header, payload)
                except OSError as exc:
                    error = self._send_failed(peer.rank, exc)
            with peer.count_lock:
                peer.queued -= 1
            if tracker is not None:
                tracker.settle(error)

    @staticmethod
    def _write(peer: _Peer, header: tuple, payload: memoryview) -> None:
        """Write one frame, a large one through the shared-memory lane when there is a free slot.
        The caller holds the peer's write lock (which also makes it the lane's only writer)."""
        slot = NO_SLOT
        if header[0] == DATA and len(payload) > _INLINE_BYTES and peer.lane_out is not None:
            taken = peer.lane_out.put(payload)
            if taken is not None:
                slot, payload = taken, memoryview(b"")
        send_frame(peer.sock, HEADER.pack(*header, slot), payload)

    def _read_loop(self, peer: _Peer) -> None:
        _on_reader_thread.active = True
        header = bytearray(HEADER.size)
        try:
            while True:
                recv_exact(peer.sock, memoryview(header))
                kind, dtype, opcode, redop, root, group, tag, seq, sub, numel, nbytes, slot = HEADER.unpack(header)
                if kind == DATA:
                    self._on_data(peer, (group, tag, seq), sub, (opcode, dtype, redop, root, numel), nbytes, slot)
                elif kind == SHM_OFFER and nbytes <= 256:
                    name = bytearray(nbytes)
                    recv_exact(peer.sock, memoryview(name))
                    self._accept_lane(peer, name.decode(errors="replace"))
                elif kind == SHM_ACCEPT and peer.lane_out is not None:
                    peer.lane_out.accepted()
                elif kind == ABORT and nbytes <= _MAX_ABORT_TEXT:
                    text = bytearray(nbytes)
                    recv_exact(peer.sock, memoryview(text))
                    self._fail_op((group, tag, seq), CollectiveMismatchError(text.decode(errors="replace")))
                elif kind == BYE:
                    self._peer_departed(peer.rank)
                    return
                else:
                    raise ConnectionError(f"malformed frame (kind {kind}, {nbytes} bytes)")
        except OSError as exc:
            if not self._closed:  # else close() shut the socket to wake us: nobody is lost
                self._peer_lost(peer.rank, f"connection lost ({exc})")
        except Exception as exc:  # a reader that dies must not leave its receives waiting
            log.exception("rank %d: reader for rank %d failed", self.rank, peer.rank)
            self._peer_lost(peer.rank, f"reader failed ({exc!r})")
        finally:
            peer.sock.close()

    def _accept_lane(self, peer: _Peer, name: str) -> None:
        try:
            peer.lane_in = shm.Inbound(name)
        except (OSError, ValueError):
            return  # another host (or no /dev/shm): the peer keeps sending everything over TCP
        peer.enqueue((HEADER.pack(SHM_ACCEPT, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, NO_SLOT), memoryview(b""), None))

    def _on_data(self, peer: _Peer, ident: tuple[int, int, int], sub: int, sig: Signature, nbytes: int,
                 slot: int) -> None:
        lend = None
        if slot == NO_SLOT:
            fill = lambda view: recv_exact(peer.sock, view)  # noqa: E731
        elif peer.lane_in is None:
            raise ConnectionError(f"rank {peer.rank} sent a shared-memory frame without a shared region")
        else:
            fill = lambda view: peer.lane_in.take(slot, view)  # noqa: E731
            lend = lambda: peer.lane_in.lend(slot, nbytes)  # noqa: E731
        handler = self._handlers.get(ident[0])
        if handler is not None:
            handler(peer.rank, ident[1], ident[2], sub, nbytes, Payload(fill, lend))
            return
        key = (peer.rank, *ident, sub)
        conflict: Op | None = None
        held: Held | None = None
        with self._lock:
            recv = self._posted.pop(key, None)
            if recv is None and ident not in self._aborted:
                active = self._active.get(ident)
                if active is not None and active.sig != sig:
                    conflict = active
                else:
                    held = self._held[key] = Held(sig, nbytes)
        if recv is not None and (recv.op.sig != sig or len(recv.view) != nbytes):
            conflict = recv.op
        if conflict is not None or (recv is None and held is None):
            fill(memoryview(bytearray(nbytes)))  # keep the stream in step; the frame is not wanted
            if conflict is not None:
                self._mismatch(conflict, peer.rank, sig, recv)
            return
        try:
            fill(recv.view if recv is not None else memoryview(held.data))
        except OSError as exc:  # the peer vanished mid-frame: whoever waits for it must hear so
            error = self._peer_lost(peer.rank, f"connection lost ({exc})")
            waiter = recv if recv is not None else held.waiter
            if waiter is not None:
                waiter.finish(error)
            raise
        if recv is not None:
            recv.finish()
            return
        with self._lock:
            held.complete = True
            waiter = held.waiter
            if waiter is not None and self._held.pop(key, None) is None:
                waiter = None  # end() withdrew it while it was read in: its op is over, nobody waits
        if waiter is not None:
            self._deliver_held(waiter, held)

    def _deliver_held(self, recv: Recv, held: Held) -> None:
        if held.sig != recv.op.sig or len(held.data) != len(recv.view):
            self._mismatch(recv.op, recv.src, held.sig, recv)
            return
        if recv.op.cancelled is None:
            recv.view[:] = held.data
        recv.finish()

    def _mismatch(self, op: Op, src: int, sig: Signature, recv: Recv | None) -> None:
        if sig == op.sig:  # same call, but the buffer sizes differ (all_gather outputs, p2p)
            what = f"a frame of a different size for {op.describe(sig)}"
        else:
            what = op.describe(sig)
        error = CollectiveMismatchError(
            f"{op.name}: rank {self.rank} called {op.describe(op.sig)} but rank {src} sent {what}; "
            f"every rank must pass matching tensors")
        self.abort(op, error)
        if recv is not None:
            recv.finish(error)

    def _fail_op(self, ident: tuple[int, int, int], error: BaseException) -> None:
        with self._lock:
            self._aborted[ident] = error
            if ident in self._active:
                self._active[ident].cancelled = error
            failed = [r for k, r in self._posted.items() if r.op.ident == ident]
            for recv in failed:
                del self._posted[(recv.src, *ident, recv.sub)]
            failed += [h.waiter for k, h in self._held.items() if h.waiter is not None and k[1:4] == ident]
        for recv in failed:
            recv.finish(error)

    def _peer_departed(self, rank: int) -> None:
        """A clean exit: every frame it sent came before its goodbye, so only receives still
        waiting on it can no longer complete; operations among the others go on."""
        with self._lock:
            error = self._departed[rank] = PeerFailure(rank, "it left the group (destroy_process_group)")
            failed = [(k, r) for k, r in self._posted.items() if r.src == rank]
            for key, _ in failed:
                del self._posted[key]
        for _, recv in failed:
            recv.finish(error)
        self._tell_listeners(error)

    def _tell_listeners(self, error: PeerFailure) -> None:
        for listener in self._failure_listeners:
            try:
                listener(error)
            except Exception:
                log.exception("rank %d: a peer-failure listener failed", self.rank)

    def _send_failed(self, rank: int, exc: OSError) -> PeerFailure:
        """A write failed: the peer is lost, unless it said goodbye first and its socket was shut since."""
        departed = self._departed.get(rank)
        return departed if departed is not None else self._peer_lost(rank, f"send failed: {exc}")

    def _peer_lost(self, rank: int, reason: str) -> PeerFailure:
        with self._lock:
            if rank in self._lost:
                return self._lost[rank]
            error = self._lost[rank] = PeerFailure(rank, reason)
            failed = [(k, r) for k, r in self._posted.items() if r.src == rank or rank in r.op.ranks]
            for key, _ in failed:
                del self._posted[key]
            failed += [(k, h.waiter) for k, h in self._held.items() if h.waiter is not None and k[0] == rank]
            peer = self._peers.get(rank)
        if not self._closed:
            log.warning("rank %d lost rank %d: %s", self.rank, rank, reason)
        for _, recv in failed:
            recv.finish(error)
        self._tell_listeners(error)
        if peer is not None:  # its send thread now settles queued frames with this error
            try:
                peer.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return error

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Say goodbye to every peer (so they report a departure, not a crash) and tear down."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
            closed = GroupBrokenError(f"rank {self.rank}: the process group was destroyed")
            pending = list(self._posted.values()) + [h.waiter for h in self._held.values() if h.waiter]
            self._posted.clear()
        for recv in pending:
            recv.finish(closed)
        bye = HEADER.pack(BYE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, NO_SLOT)
        done = SendTracker()
        for peer in peers:
            done.add()
            peer.enqueue((bye, memoryview(b""), done))
            peer.outbox.put(None)
        try:
            done.wait(time.monotonic() + timeout.total_seconds(), f"rank {self.rank} closing")
        except (TimeoutError, PeerFailure):
            pass  # a peer that is already gone needs no goodbye
        for peer in peers:
            if peer.lane_out is not None:
                peer.lane_out.close_descriptor()
            try:  # our goodbye is ahead of the FIN; we read on until theirs, so they see no reset
                peer.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
        except OSError:
            pass
        self._listener.close()
        deadline = time.monotonic() + timeout.total_seconds()
        self._join_threads(min(deadline, time.monotonic() + _DRAIN_S))  # peers closing too say goodbye at once
        for peer in peers:
            try:  # a peer still busy: stop reading it, which wakes our reader
                peer.sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        self._join_threads(deadline)

    def _join_threads(self, deadline: float) -> None:
        """Wait for our threads to end, so none is left running when the interpreter exits. A
        handshake still in progress ends by its own timeout; one that outlives `deadline` is left."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
