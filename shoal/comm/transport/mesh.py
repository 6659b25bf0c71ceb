"""Authenticated peer-to-peer byte transport: a full mesh of connections between the ranks of a job
(a `PeerLink` per peer, or several: `streams`), operations' frames sent over them and matched on arrival
(`Matcher`), and the bookkeeping of peers that crash or leave."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

from shoal import config
from shoal.comm.transport import striping
from shoal.comm.transport.connecting import Connecting, listen
from shoal.comm.transport.delivery import INLINE_BYTES
from shoal.comm.transport.frame_header import ACK_NOW, FrameHeader, Kind
from shoal.comm.transport.frames import Op, Payload, Recv, SendTracker
from shoal.comm.transport.link import PeerLink
from shoal.comm.transport.matching import Matcher
from shoal.comm.transport.reading import MAX_ABORT_TEXT
from shoal.errors import CollectiveMismatchError, PeerFailure
from shoal.observe import events
from shoal.observe.flight import recorder

log = logging.getLogger(__name__)

# How long close() reads on for the goodbyes of peers closing at the same time, before it stops
# reading the rest: reading them out spares those peers a connection reset.
_DRAIN_S = 1.0

# handler(src, tag, seq, sub, nbytes, payload): takes one frame of a group served by a handler. It runs
# on the reader thread and must read the payload (a frames.Payload) before it returns.
FrameHandler = Callable[[int, int, int, int, int, Payload], None]


class Transport(Connecting):
    """Full mesh of authenticated connections between the ranks of one job."""

    def __init__(self, rank: int, world_size: int, *, secret: bytes, session: bytes, hosts: Sequence[str],
                 stall_timeout: timedelta, heal_timeout: timedelta | None = None,
                 heartbeat_timeout: timedelta | None = None, open_membership: bool = False, streams: int = 1) -> None:
        """`hosts`: the addresses we listen on, one port on each; connection s to a peer goes between our
        and its address s modulo their number. With `open_membership`, ranks from `world_size` on may join
        later: they dial every member. `streams`: how many TCP connections each pair of ranks has
        (config.SHOAL_STREAMS); large frames to a peer that does not share memory with us go round them."""
        if not 1 <= streams <= config.MAX_STREAMS:
            raise ValueError(f"streams must be from 1 to {config.MAX_STREAMS}, not {streams}")
        self.rank, self.world_size, self._open, self._streams = rank, world_size, open_membership, streams
        self._stall_timeout = stall_timeout
        self._heal_timeout = _seconds(heal_timeout, config.SHOAL_HEAL_TIMEOUT)
        self._heartbeat_timeout = _seconds(heartbeat_timeout, config.SHOAL_HEARTBEAT_TIMEOUT)
        config.SHOAL_HOST_ID.get()  # a bad name fails here, naming itself, not later inside a link's thread
        self._secret, self._session = secret, session
        self._lock = threading.Lock()
        self._links: dict[tuple[int, int], PeerLink] = {}
        self._dialled: dict[int, tuple[str, int]] = {}
        self._homing: dict[tuple[int, int], tuple[float, float]] = {}
        self._refused: dict[int, str] = {}
        self._links_changed = threading.Condition(self._lock)
        self._matcher = Matcher(rank, self.abort, streams=streams)
        self._handlers: dict[int, FrameHandler] = {}
        self._failure_listeners: list[Callable[[PeerFailure], None]] = []
        self.closed = False
        # Every thread we start, so that close() can join them: a thread still running (or ending)
        # while the interpreter finalizes can abort the process inside torch's thread-local cleanup.
        self._threads: list[threading.Thread] = []
        self.hosts = tuple(hosts)
        self._listeners = listen(self.hosts, backlog=max(16, world_size))
        self.address = (",".join(self.hosts), self._listeners[0].getsockname()[1])
        self._stopping = threading.Event()
        for listener in self._listeners:
            self._start(self._accept_loop, listener, name="shoal-accept")
        self._start(self._heartbeat_loop, name="shoal-heartbeat")

    def _start(self, target: Callable[..., None], *args: object, name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    @property
    def streams(self) -> int:
        """How many connections each pair of ranks has."""
        return self._streams

    def serve(self, group: int, handler: FrameHandler) -> None:
        """Hand every frame of `group` to `handler` instead of matching it to posted receives: for
        messages nobody posted a receive for in advance (RPC requests)."""
        self._handlers[group] = handler

    def failure(self, rank: int) -> PeerFailure | None:
        """Why peer `rank` can take part in nothing any more (it crashed, fell silent or left), or None."""
        return self._matcher.failure(rank)

    def on_peer_failure(self, listener: Callable[[PeerFailure], None]) -> None:
        """Call `listener` once for each peer that crashes or leaves, on the thread that noticed."""
        self._failure_listeners.append(listener)

    # ---- operations --------------------------------------------------------------------------

    def begin(self, op: Op) -> None:
        """Register a collective so that frames disagreeing with it are caught as they arrive."""
        self._matcher.begin(op)

    def check(self, op: Op) -> None:
        """Raise if `op` can no longer complete: a rank taking part failed, or it was aborted elsewhere."""
        self._matcher.check_usable(op)

    def end(self, op: Op) -> None:
        """Forget an operation; receives still posted for it (after a failure) are withdrawn."""
        self._matcher.end(op)

    def post_recv(self, op: Op, src: int, sub: int, view: memoryview, *,
                  process: Callable[[], None] | None = None,
                  on_done: Callable[[Recv], None] | None = None) -> Recv:
        """Post the receive of frame (src, op, sub) into `view`, so it lands there without a copy."""
        recv = Recv(op, src, sub, view, process, on_done)
        self._matcher.post(recv)
        return recv

    def post_recv_from_any(self, ops: list[Op], view: memoryview, *, on_done: Callable[[Recv], None]) -> None:
        """Post the receive of frame (op, 0) from each op's one peer into `view`, of which only the first
        to arrive is taken (a receive from any source); `on_done` learns which from its `src`."""
        self._matcher.post_first([Recv(op, op.ranks[0], 0, view, None, on_done) for op in ops])

    def send(self, op: Op, dst: int, sub: int, payload: memoryview, tracker: SendTracker | None) -> None:
        """Send frame (op, sub) to `dst` without waiting; `tracker` learns when `payload` may be reused."""
        self._matcher.check_usable(op, dst)
        opcode, dtype, redop, root, numel = op.sig
        header = FrameHeader(Kind.DATA, len(payload), op.group, op.tag, op.seq, sub, opcode, dtype, redop, root,
                             numel, flags=ACK_NOW)
        self._route(dst, striping.spread(op.seq, sub), len(payload)).send(header, payload, tracker)

    def _route(self, dst: int, spread: int, nbytes: int) -> PeerLink:
        """The connection a frame to `dst` goes on: large frames go round the pair's connections by
        `spread`, unless they go through shared memory; the rest keep to the first."""
        first = self._link(dst)
        if self._streams == 1 or nbytes <= INLINE_BYTES or first.shares_memory:
            return first
        return self._link(dst, spread % self._streams)

    def send_message(self, dst: int, group: int, tag: int, seq: int, sub: int, payload: memoryview,
                     tracker: SendTracker | None, *, acknowledge: bool) -> None:
        """Send frame (group, tag, seq, sub) of a served group (`serve`) to `dst`: no operation to match
        or abort, so only the peer must still be there (fewer calls than `send`, for messages sent one
        at a time, as RPC's are, where each costs latency).

        The calling thread writes even a large frame itself when the peer's queue is idle, as it does
        small ones (unless it is a connection's reader: see `PeerLink.send`): right for a caller that
        waits for the answer anyway, wrong for one that has other frames to post meanwhile (the ring
        algorithms, which use `send`).

        `acknowledge=False` lets the peer acknowledge the frame lazily (with whatever it sends back next,
        or its next heartbeat): for a frame nobody waits on, whose tracker may settle late.
        """
        self._matcher.check_peer(dst)
        header = FrameHeader(Kind.DATA, len(payload), group, tag, seq, sub, flags=ACK_NOW if acknowledge else 0)
        self._link(dst).send(header, payload, tracker, eager=True)

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
        text = memoryview(str(error).encode()[:MAX_ABORT_TEXT])
        header = FrameHeader(Kind.ABORT, len(text), op.group, op.tag, op.seq)
        for rank in op.ranks:
            link = self._links.get((rank, 0))
            if link is not None and not self._matcher.is_lost(rank):
                link.send(header, text, None)
        self._matcher.fail_op(op.ident, error, op.ranks[0])

    # ---- what the links report (LinkOwner) ---------------------------------------------------------

    def on_data(self, link: PeerLink, header: FrameHeader, payload: Payload) -> None:
        handler = self._handlers.get(header.group)
        if handler is not None:
            handler(link.rank, header.tag, header.seq, header.sub, header.nbytes, payload)
            return
        arrival = self._matcher.arrive(link.rank, header.ident, header.sub, header.signature, header.nbytes)
        try:
            payload.fill(arrival.view)
        except PeerFailure as exc:  # the link could not be healed: whoever waits for the frame must hear so
            arrival.failed(exc)
            raise
        except OSError as exc:
            arrival.failed(self.link_lost(link.rank, f"connection lost ({exc})"))
            raise
        arrival.done()

    def on_abort(self, link: PeerLink, header: FrameHeader, text: str) -> None:
        self._matcher.fail_op(header.ident, CollectiveMismatchError(text), link.rank)

    def on_bye(self, link: PeerLink) -> PeerFailure:
        if link.stream:  # a peer says goodbye on its first connection last, once the others have theirs
            return PeerFailure(link.rank, "it is leaving the group (destroy_process_group)")
        error = self._matcher.peer_departed(link.rank)
        self._tell_listeners(error)
        return error

    def link_lost(self, rank: int, reason: str) -> PeerFailure:
        error, first = self._matcher.peer_lost(rank, reason)
        if not first:
            return error
        if not self.closed:
            log.warning("rank %d lost rank %d: %s", self.rank, rank, reason)
        self._tell_listeners(error)
        for link in self._streams_to(rank):
            link.fail(error)
            link.shutdown(socket.SHUT_RDWR)  # wakes its reader
        if not self.closed:  # recorded once everyone waiting on the peer knows
            events.instant(f"rank {rank} lost", events.FAULT, peer=rank, reason=reason)
            recorder.dump(f"lost rank {rank}: {reason}")
        return error

    def sever(self, rank: int) -> None:
        """Drop the connections to `rank` as a network fault would; the links heal themselves. For fault
        drills and tests of retransmission."""
        for link in self._streams_to(rank):
            link.sever()

    def _heartbeat_loop(self) -> None:
        interval = self._heartbeat_timeout / 5
        while not self._stopping.wait(interval):
            now = time.monotonic()
            links = list(self._links.values())
            peer_heard: dict[int, float] = {}  # when each peer was last heard, on any connection still open
            for link in links:
                if not link.ended:
                    peer_heard[link.rank] = max(peer_heard.get(link.rank, link.last_heard), link.last_heard)
            for link in links:
                link.heartbeat(now, interval, self._heartbeat_timeout, peer_heard.get(link.rank, link.last_heard))
            try:  # whatever goes wrong there, the heartbeats go on
                self.move_home(links, interval)
            except Exception:
                log.exception("rank %d: checking whether failed-over connections can move back failed", self.rank)

    def _tell_listeners(self, error: PeerFailure) -> None:
        for listener in self._failure_listeners:
            try:
                listener(error)
            except Exception:
                log.exception("rank %d: a peer-failure listener failed", self.rank)

    # ---- teardown ----------------------------------------------------------------------------

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Say goodbye to every peer (so they report a departure, not a crash) and tear down."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            links = list(self._links.values())
        self._stopping.set()
        self._matcher.close()
        done = SendTracker()
        for peer in {link.rank for link in links}:
            self._farewell(peer, done)
        try:
            done.wait(time.monotonic() + timeout.total_seconds(), f"rank {self.rank} closing")
        except (TimeoutError, PeerFailure):
            pass  # a peer that is already gone needs no goodbye
        for link in links:
            link.release_lane()
            link.shutdown(socket.SHUT_WR)  # our goodbye is ahead of the FIN; we read on until theirs
        for listener in self._listeners:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes its accept loop
            except OSError:
                pass
            listener.close()
        deadline = time.monotonic() + timeout.total_seconds()
        self._join_threads(min(deadline, time.monotonic() + _DRAIN_S))  # peers closing too say goodbye at once
        for link in links:
            link.shutdown(socket.SHUT_RD)  # a peer still busy: stop reading it, which wakes our reader
        self._join_threads(deadline)

    def _farewell(self, peer: int, done: SendTracker) -> None:
        """Say goodbye to `peer` on each of our connections to it; `done` settles when it has heard. The
        goodbye on the first goes once those on the others are acknowledged: a peer told we left then has
        every frame we sent it, whichever connection it took. Each peer waits only for its own."""
        links = self._streams_to(peer)
        first, others = links[0], links[1:]
        if first.stream != 0 or not others:  # no first connection yet (closed while connecting), or only it
            for link in links:
                link.finish(done)
            return
        done.add()  # held until the first connection's goodbye is queued

        def then_first(_: BaseException | None) -> None:
            first.finish(done)
            done.settle(None)
        side = SendTracker(then_first)
        side.add()  # held until every goodbye is queued, so that none settling early sends the first's
        for link in others:
            link.finish(side)
        side.settle(None)

    def _join_threads(self, deadline: float) -> None:
        """Wait for our threads to end, so none is left running when the interpreter exits. A
        handshake still in progress ends by its own timeout; one that outlives `deadline` is left."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


def _seconds(given: timedelta | None, variable: config.Variable[float]) -> float:
    return given.total_seconds() if given is not None else variable.get()
