"""Sends and receives of the "shoal" backend's process group (native.py). Each (peer, tag) numbers its
messages, so the k-th send from A to B with tag t meets the k-th receive on B from A with tag t. A receive
from any source posts one for each peer's next message and takes the first to arrive; the receives issued
behind it on its tag are numbered once it has, since until then no one knows whose message it took.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta

import torch

from shoal.comm.backends.signatures import OPS, describe
from shoal.comm.backends.work import OpQueue, Work
from shoal.comm.transport import dtypes
from shoal.comm.transport.frames import Op, Recv, SendTracker, Signature, as_bytes
from shoal.comm.transport.mesh import Transport
from shoal.comm.transport.staging import staged_flat
from shoal.errors import GroupBrokenError
from shoal.observe import events
from shoal.observe.flight import recorder


class PointToPoint:
    """The sends and receives of `ShoalProcessGroup` (native.py), which sets up the state declared here
    and gives `group_rank` and `_refuse_if_forked`."""

    rank: int
    size: int
    ranks: list[int]
    timeout: timedelta
    transport: Transport
    _group_id: int
    _issue: threading.Lock
    _queue: OpQueue
    _broken: BaseException | None
    _sent: defaultdict
    _received: defaultdict[tuple[int, int], int]
    _behind_any: dict[int, list[tuple[Work, torch.Tensor, Callable[[], None], int | None]]]

    def _p2p_sig(self, tensor: torch.Tensor, name: str) -> Signature:
        """The signature of a send or receive of `tensor`, or the error that refuses it: checked before
        the message is numbered, so that a refused one takes no number on either side."""
        if self._broken is not None:
            raise GroupBrokenError(f"{name}: this group failed earlier ({self._broken}); destroy it and "
                                   f"create a new one")
        return (OPS.index("send/recv"), dtypes.code(tensor.dtype, f"{name} on the shoal backend"), 0, 0, tensor.numel())

    def _p2p_op(self, peer: int, tag: int, seq: int, sig: Signature, tensor: torch.Tensor, name: str, work: Work, *,
                record: bool = True) -> Op:
        if record:
            work.flight = recorder.record(self._group_id, self.ranks, seq, name, functools.partial(describe, sig),
                                          tensor.nbytes, peer=self.ranks[peer], tag=tag)
        return Op(self._group_id, tag, seq, sig, (self.ranks[peer],), self.timeout, name, describe,
                  deadline=work.deadline)

    def _p2p_running(self, work: Work, op: Op, src: int, dst: int, flat: torch.Tensor) -> events.Started | None:
        """Start a send's or receive's span; returns its start, where the flow between the two is anchored."""
        return work.running({"bytes": flat.nbytes, "src": src, "dst": dst, "tag": op.tag,
                             "seq": op.seq, "group": self._group_id})

    def _flow(self, begins: bool, src: int, dst: int, op: Op, at: events.Started | None) -> None:
        """One end of the arrow from a send (`src`) to its receive (`dst`), numbered alike in both traces
        (JSON-safe: under 2**53); nothing, not even the number, while untraced (`at` is None)."""
        if at is not None:
            key = f"{self._group_id}:{src}:{dst}:{op.tag}:{op.seq}".encode()
            events.flow(begins, int.from_bytes(hashlib.blake2b(key, digest_size=6).digest(), "big"), at)

    def _start_send(self, tensor: torch.Tensor, dst: int, tag: int, blocking: bool) -> Work:
        self._refuse_if_forked()
        flat, _ = staged_flat(tensor)
        work = Work(f"send to rank {self.ranks[dst]}", self.timeout)

        def start() -> None:
            me, peer = self.transport.rank, self.ranks[dst]
            self._flow(True, me, peer, op, self._p2p_running(work, op, me, peer, flat))
            try:
                tracker = SendTracker(on_done=work.finish)
                self.transport.send(op, self.ranks[dst], 0, as_bytes(flat), tracker)
            except Exception as exc:
                work.finish(exc)

        with self._issue:
            sig = self._p2p_sig(flat, "send")
            op = self._p2p_op(dst, tag, next(self._sent[(dst, tag)]), sig, flat, "send", work)
            here = self._queue.submit(start, inline_if_idle=True)
        if here:
            self._queue.run_here(start)
        return work

    def _start_recv(self, tensor: torch.Tensor, src: int | None, tag: int, blocking: bool) -> Work:
        self._refuse_if_forked()
        flat, back = staged_flat(tensor)
        work = Work("recv from any rank" if src is None else f"recv from rank {self.ranks[src]}", self.timeout)
        with self._issue:
            behind = self._behind_any.get(tag)
            if behind is not None:
                behind.append((work, flat, back, src))
                return work
            start = self._numbered_recv(work, flat, back, src, tag)
            try:
                here = self._queue.submit(start, inline_if_idle=True)
            except BaseException:
                if src is None:
                    del self._behind_any[tag]  # never started: nothing waits behind it
                raise
        if here:
            self._queue.run_here(start)
        return work

    def _numbered_recv(self, work: Work, flat: torch.Tensor, back: Callable[[], None], src: int | None,
                       tag: int) -> Callable[[], None]:
        """Number a receive (the caller holds the issue lock); returns what posts it."""
        sig = self._p2p_sig(flat, "recv")
        if src is None:
            return self._recv_from_any(work, flat, back, tag, sig)
        op = self._p2p_op(src, tag, self._received[(src, tag)], sig, flat, "recv", work)
        self._received[(src, tag)] += 1
        started: events.Started | None = None

        def landed(recv: Recv) -> None:
            if recv.error is None:
                back()
                self._flow(False, self.ranks[src], self.transport.rank, op, started)
            work.finish(recv.error)

        def start() -> None:
            nonlocal started
            started = self._p2p_running(work, op, self.ranks[src], self.transport.rank, flat)
            try:
                self.transport.post_recv(op, self.ranks[src], 0, as_bytes(flat), on_done=landed)
            except Exception as exc:
                work.finish(exc)

        return start

    def _recv_from_any(self, work: Work, flat: torch.Tensor, back: Callable[[], None], tag: int,
                       sig: Signature) -> Callable[[], None]:
        """A receive of each peer's next message with `tag`, of which the first to arrive is taken; the
        receives issued after it on that tag wait until then (`_behind_any`)."""
        peers = [p for p in range(self.size) if p != self.rank]
        if not peers:
            raise ValueError("recv from any source: this group has no other rank to receive from")
        ops = [self._p2p_op(p, tag, self._received[(p, tag)], sig, flat, "recv", work, record=False) for p in peers]
        work.flight = recorder.record(self._group_id, self.ranks, -1, "recv", functools.partial(describe, sig),
                                      flat.nbytes, tag=tag)
        self._behind_any[tag] = []
        once = threading.Lock()

        def landed(recv: Recv) -> None:
            if not once.acquire(blocking=False):
                return  # the matcher settles a receive from any source once; this guards the numbering
            # A frame that was taken numbers its sender's next message, even one that disagreed.
            self._any_matched(tag, self.group_rank(recv.src, "src") if recv.taken else None)
            if recv.error is None:
                back()
                work.received_from(recv.src)
            work.finish(recv.error)

        def start() -> None:
            work.running({"bytes": flat.nbytes, "tag": tag, "group": self._group_id})
            try:
                self.transport.post_recv_from_any(ops, as_bytes(flat), on_done=landed)
            except Exception as exc:
                if once.acquire(blocking=False):
                    self._any_matched(tag, None)
                    work.finish(exc)

        return start

    def _any_matched(self, tag: int, sender: int | None) -> None:
        """A receive from any source on `tag` took `sender`'s next message (or failed: None): number the
        receives issued behind it, which may include another from any source."""
        refused = []
        with self._issue:
            if sender is not None:
                self._received[(sender, tag)] += 1
            behind = self._behind_any.pop(tag)
            for i, (work, flat, back, src) in enumerate(behind):
                if tag in self._behind_any:  # one of them is from any source too: the rest wait for it
                    self._behind_any[tag].extend(behind[i:])
                    break
                try:
                    self._queue.submit(self._numbered_recv(work, flat, back, src, tag))  # this may be a reader thread
                except Exception as exc:
                    if src is None:
                        self._behind_any.pop(tag, None)  # never started: nothing waits behind it
                    refused.append((work, exc))
        for work, exc in refused:  # outside the lock: a done-callback may issue another send or receive
            work.finish(exc)
