"""Matching arriving frames to posted receives, without sockets: each frame goes into the buffer its
receive posted (zero-copy), or is held until that receive is posted, or is dropped when its operation
is over; frames that disagree with the operation they claim to belong to abort it. Also the record of
failed operations and peers, which decides whether an operation may still proceed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from shoal.comm.transport import striping
from shoal.comm.transport.frames import Held, Op, Recv, Signature
from shoal.errors import CollectiveMismatchError, GroupBrokenError, PeerFailure

# Frame key: (src, group, tag, seq, sub)
Key = tuple[int, int, int, int, int]
_Frame = TypeVar("_Frame", Held, Recv)


class Arrival:
    """Where the payload of one arriving frame goes: read it into `view`, then call `done()`, or
    `failed(error)` when it cannot be read."""

    __slots__ = ("_conflict", "_held", "_key", "_matcher", "_recv", "_sig", "view")

    def __init__(self, matcher: Matcher, key: Key, sig: Signature, view: memoryview, recv: Recv | None,
                 held: Held | None, conflict: Op | None) -> None:
        self._matcher, self._key, self._sig, self.view = matcher, key, sig, view
        self._recv, self._held, self._conflict = recv, held, conflict

    def done(self) -> None:
        if self._conflict is not None:
            self._matcher.mismatch(self._conflict, self._key[0], self._sig, self._recv)
        elif self._recv is not None:
            self._recv.finish()
        elif self._held is not None:
            self._matcher.held_complete(self._key, self._held)

    def failed(self, error: BaseException) -> None:
        waiter = self._recv if self._recv is not None else self._held.waiter if self._held is not None else None
        if waiter is not None:
            waiter.finish(error)


class Matcher:
    """The receive side of every operation of one transport, and the failures that end them."""

    def __init__(self, rank: int, abort: Callable[[Op, BaseException], None], *, streams: int = 1) -> None:
        """`streams`: the connections per pair, at most as many parts as a large frame is cut into (striping.py)."""
        self.rank = rank
        self._abort = abort  # fails an op here and tells the other ranks taking part
        self._streams = streams
        self._lock = threading.Lock()
        self._posted: dict[Key, Recv] = {}
        # Receives posted together, of which the first frame to arrive is taken (from any source): each
        # one's key -> all their keys
        self._rivals: dict[Key, tuple[Key, ...]] = {}
        self._held: dict[Key, Held] = {}
        self._active: dict[tuple[int, int, int], Op] = {}
        self._aborted: dict[tuple[int, ...], BaseException] = {}  # by _abort_key
        self._lost: dict[int, PeerFailure] = {}  # crashed: every op they take part in fails
        self._departed: dict[int, PeerFailure] = {}  # said goodbye after their last frame
        self._closed = False

    # ---- operations ------------------------------------------------------------------------------

    def begin(self, op: Op) -> None:
        with self._lock:
            self.check_usable(op)
            self._active[op.ident] = op

    def end(self, op: Op) -> None:
        with self._lock:
            op.cancelled = op.cancelled or GroupBrokenError(f"{op.name} has ended")
            self._active.pop(op.ident, None)
            for key in [k for k, r in self._posted.items() if r.op is op]:
                self._withdraw(key)
            for key in [k for k in self._held if k[1:4] == op.ident]:
                del self._held[key]

    def post(self, recv: Recv) -> None:
        key = (recv.src, *recv.op.ident, recv.sub)
        other_cut: Held | None = None
        with self._lock:
            held = self._held.get(key)
            recv.taken = held is not None
            if held is not None and held.complete:
                del self._held[key]  # a frame that arrived is delivered, even if its sender has left since
            else:
                self.check_usable(recv.op, recv.src)
                if held is not None:
                    held.waiter = recv  # handed over when the frame is in
                    return
                other_cut = self._cut_otherwise(self._held, key)
                if other_cut is None:
                    self._posted[key] = recv
                    return
        if other_cut is not None:
            self.mismatch(recv.op, recv.src, other_cut.sig, recv)  # its sender cut the frame otherwise
        else:
            self._deliver_held(recv, held)

    def post_first(self, candidates: list[Recv]) -> None:
        """Post receives of which only the first frame to arrive is taken (a receive from any source: one
        candidate per peer); the rest are then withdrawn, and the receive succeeds or fails as one. A frame
        already here wins, the earliest first; a candidate whose peer is gone is left out, and when none is
        left the last one's error is raised."""
        keys = {(r.src, *r.op.ident, r.sub): r for r in candidates}
        error: BaseException | None = None
        with self._lock:
            first = next((key for key, held in self._held.items()  # in arrival order
                          if key in keys and (held.complete or key[0] not in self._lost)), None)
            if first is None:
                usable = {}
                for key, recv in keys.items():
                    try:
                        self.check_usable(recv.op, recv.src)
                        usable[key] = recv
                    except PeerFailure as exc:
                        error = exc
                if not usable and error is not None:
                    raise error
                self._posted.update(usable)
                for key in usable:
                    self._rivals[key] = tuple(usable)
                return
        self.post(keys[first])

    def check_usable(self, op: Op, peer: int | None = None) -> None:
        """Raise if `op` cannot proceed: closed, aborted, a member crashed, or `peer` has left."""
        self._refuse_if_closed()
        aborted = self._aborted.get(_abort_key(op.ident, op.ranks[0]))
        if aborted is not None:
            raise aborted
        for rank in (op.ranks if peer is None else (peer, *op.ranks)):
            if rank in self._lost:
                raise self._lost[rank]
        if peer in self._departed:  # only the peer itself: others may finish what it took part in
            raise self._departed[peer]

    # ---- arriving frames ---------------------------------------------------------------------------

    def arrive(self, src: int, ident: tuple[int, int, int], sub: int, sig: Signature, nbytes: int) -> Arrival:
        """Where frame (src, ident, sub) goes: its posted receive, a new held buffer, or (unwanted, or
        disagreeing with its op) a scratch buffer that keeps the stream in step."""
        key = (src, *ident, sub)
        conflict: Op | None = None
        held: Held | None = None
        with self._lock:
            recv = self._posted.pop(key, None)
            if recv is not None:
                recv.taken = True
                self._drop_rivals(key)  # the first frame for a receive from any source
            if recv is None and _abort_key(ident, src) not in self._aborted:
                active = self._active.get(ident)
                if active is not None and (active.sig != sig or self._cut_otherwise(self._posted, key) is not None):
                    conflict = active
                else:
                    held = self._held[key] = Held(sig, nbytes)
        if recv is not None and (recv.op.sig != sig or len(recv.view) != nbytes):
            conflict = recv.op
        if conflict is not None or (recv is None and held is None):
            return Arrival(self, key, sig, memoryview(bytearray(nbytes)), recv, None, conflict)
        view = recv.view if recv is not None else memoryview(held.data)
        return Arrival(self, key, sig, view, recv, held, None)

    def held_complete(self, key: Key, held: Held) -> None:
        with self._lock:
            held.complete = True
            waiter = held.waiter
            if waiter is not None and self._held.pop(key, None) is None:
                waiter = None  # end() withdrew it while it was read in: its op is over, nobody waits
        if waiter is not None:
            self._deliver_held(waiter, held)

    def _cut_otherwise(self, frames: dict[Key, _Frame], key: Key) -> _Frame | None:
        """The first part of frame `key` as cut into another number of parts, found among `frames`: its
        sender and receiver disagree on its size, so neither will ever see the other's parts under `key`."""
        if self._streams == 1:
            return None
        src, group, tag, seq, sub = key
        for other in striping.first_parts_of_other_cuts(sub, self._streams):
            found = frames.get((src, group, tag, seq, other))
            if found is not None:
                return found
        return None

    def _deliver_held(self, recv: Recv, held: Held) -> None:
        if held.sig != recv.op.sig or len(held.data) != len(recv.view):
            self.mismatch(recv.op, recv.src, held.sig, recv)
            return
        if recv.op.cancelled is None:
            recv.view[:] = held.data
        recv.finish()

    def mismatch(self, op: Op, src: int, sig: Signature, recv: Recv | None) -> None:
        if sig == op.sig:  # same call, but the buffer sizes differ (all_gather outputs, p2p)
            what = f"a frame of a different size for {op.describe(sig)}"
        else:
            what = op.describe(sig)
        error = CollectiveMismatchError(
            f"{op.name}: rank {self.rank} called {op.describe(op.sig)} but rank {src} sent {what}; "
            f"every rank must pass matching tensors")
        self._abort(op, error)
        if recv is not None:
            recv.finish(error)

    # ---- failures ----------------------------------------------------------------------------------

    def fail_op(self, ident: tuple[int, int, int], error: BaseException, peer: int) -> None:
        """Fail operation `ident` (for a send or receive: the one with `peer`, the rank the abort came from
        or went to) and refuse its frames from now on."""
        p2p = ident[1] >= 0
        with self._lock:
            self._aborted[_abort_key(ident, peer)] = error
            if ident in self._active:
                self._active[ident].cancelled = error
            failed = []
            for recv in [r for r in self._posted.values() if r.op.ident == ident and not (p2p and r.src != peer)]:
                key = (recv.src, *ident, recv.sub)
                if key in self._posted:  # not withdrawn already as a rival: a receive from any source fails as one
                    failed.append(self._posted.pop(key))
                    self._drop_rivals(key)
            failed += [h.waiter for k, h in self._held.items()
                       if h.waiter is not None and k[1:4] == ident and not (p2p and k[0] != peer)]
        for recv in failed:
            recv.finish(error)

    def check_peer(self, peer: int) -> None:
        """Raise if nothing more can go to `peer`: closed, or the peer crashed or left."""
        self._refuse_if_closed()
        failure = self.failure(peer)
        if failure is not None:
            raise failure

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise GroupBrokenError(f"rank {self.rank}: the transport is closed")

    def failure(self, rank: int) -> PeerFailure | None:
        """Why `rank` is gone (crashed or left), or None while it is a member."""
        return self._lost.get(rank) or self._departed.get(rank)

    def is_lost(self, rank: int) -> bool:
        return rank in self._lost

    def peer_departed(self, rank: int) -> PeerFailure:
        """A clean exit: every frame it sent came before its goodbye, so only receives still
        waiting on it can no longer complete; operations among the others go on."""
        with self._lock:
            error = self._departed[rank] = PeerFailure(rank, "it left the group (destroy_process_group)")
            failed = [(k, r) for k, r in self._posted.items() if r.src == rank]
            failed = [(k, r) for k, r in failed if not self._withdraw(k)]
        for _, recv in failed:
            recv.finish(error)
        return error

    def peer_lost(self, rank: int, reason: str) -> tuple[PeerFailure, bool]:
        """Fail everything `rank` takes part in; the error, and whether this call is the first to say so."""
        with self._lock:
            if rank in self._lost:
                return self._lost[rank], False
            error = self._lost[rank] = PeerFailure(rank, reason)
            failed = [(k, r) for k, r in self._posted.items() if r.src == rank or rank in r.op.ranks]
            failed = [(k, r) for k, r in failed if not self._withdraw(k)]
            failed += [(k, h.waiter) for k, h in self._held.items() if h.waiter is not None and k[0] == rank]
        for _, recv in failed:
            recv.finish(error)
        return error, True

    def _drop_rivals(self, key: Key) -> None:
        """Withdraw the other candidates of the receive from any source `key` is one of (the caller holds
        the lock and has taken `key` itself)."""
        for rival in self._rivals.pop(key, ()):
            self._posted.pop(rival, None)
            self._rivals.pop(rival, None)

    def _withdraw(self, key: Key) -> bool:
        """Take a posted receive back (the caller holds the lock); True when rivals of it are still posted,
        so that it must not fail: another source may yet send."""
        del self._posted[key]
        rivals = self._rivals.pop(key, ())
        left = tuple(k for k in rivals if k != key)
        for rival in left:
            self._rivals[rival] = left
        return bool(left)

    def close(self) -> None:
        """Fail every receive still waiting: the transport is going away."""
        with self._lock:
            self._closed = True
            pending, seen = [], set()
            for key, recv in self._posted.items():
                if key not in seen:  # one of a receive from any source's candidates
                    pending.append(recv)
                    seen.update(self._rivals.get(key, ()))
            pending += [h.waiter for h in self._held.values() if h.waiter]
            self._posted.clear()
            self._rivals.clear()
        closed = GroupBrokenError(f"rank {self.rank}: the process group was destroyed")
        for recv in pending:
            recv.finish(closed)


def _abort_key(ident: tuple[int, int, int], peer: int) -> tuple[int, ...]:
    """What an abort is recorded under. A collective's ident (tag -1) is the same on every rank; a send's or
    receive's (tag >= 0) is numbered per peer, so with another peer the same ident is another message."""
    return ident if ident[1] < 0 else (*ident, peer)
