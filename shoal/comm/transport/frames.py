"""How one operation's frames are tracked: its identity and signature, posted receives, frames held
until their receive is posted, and the accounting of pending sends."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch

from shoal.forks import renew_locks_in_child

Signature = tuple[int, int, int, int, int]  # (op, dtype, reduce op, root, numel)


def as_bytes(flat: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's storage (no copy): what a frame's payload is."""
    return memoryview(flat.view(torch.uint8).numpy())


class Op:
    """One operation in flight: the identity frames carry, what every rank must agree on, who takes
    part (global ranks) and when to give up."""

    __slots__ = ("cancelled", "deadline", "describe", "group", "name", "ranks", "seq", "sig", "tag", "timeout")

    def __init__(self, group: int, tag: int, seq: int, sig: Signature, ranks: tuple[int, ...],
                 timeout: timedelta, name: str, describe: Callable[[Signature], str],
                 deadline: float | None = None) -> None:
        self.group, self.tag, self.seq, self.sig, self.ranks = group, tag, seq, sig, ranks
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout.total_seconds() if deadline is None else deadline
        self.name = name
        self.describe = describe
        # Why the op ended early, once it has: frames still arriving for it are then discarded.
        self.cancelled: BaseException | None = None

    @property
    def ident(self) -> tuple[int, int, int]:
        return (self.group, self.tag, self.seq)


_FINISH_LOCK = threading.Lock()
renew_locks_in_child(globals(), "_FINISH_LOCK")


class Recv:
    """A posted receive: the frame (src, op, sub) lands in `view`; `event` is set when it has.

    `process` runs on the reader thread as soon as the frame is in, before `event` is set (the ring
    algorithms reduce and forward there, so the pipeline advances without waking another thread);
    `on_done` runs after, whatever the outcome.
    """

    __slots__ = ("claimed", "error", "event", "on_done", "op", "process", "src", "sub", "taken", "view")

    def __init__(self, op: Op, src: int, sub: int, view: memoryview,
                 process: Callable[[], None] | None, on_done: Callable[[Recv], None] | None) -> None:
        self.op, self.src, self.sub, self.view = op, src, sub, view
        self.process, self.on_done = process, on_done
        self.event = threading.Event()
        self.error: BaseException | None = None
        self.claimed = False
        self.taken = False  # a frame was matched to it (set by the matcher, even if it then disagrees)

    def finish(self, error: BaseException | None = None) -> None:
        """Complete the receive once: a failure and a late frame may race to do it."""
        with _FINISH_LOCK:
            if self.claimed:
                return
            self.claimed = True
        if error is None and self.op.cancelled is not None:
            error = self.op.cancelled
        if error is None and self.process is not None:
            try:
                self.process()
            except Exception as exc:
                error = exc
        self.error = error
        self.event.set()
        if self.on_done is not None:
            self.on_done(self)


class SendTracker:
    """Counts the frames of one operation still queued for sending; `on_done` runs when none are."""

    def __init__(self, on_done: Callable[[BaseException | None], None] | None = None) -> None:
        self._pending = 0
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._on_done = on_done

    def add(self) -> None:
        with self._cond:
            self._pending += 1

    def settle(self, error: BaseException | None) -> None:
        with self._cond:
            self._pending -= 1
            self._error = self._error or error
            finished = self._pending == 0
            if finished:
                self._cond.notify_all()
        if finished and self._on_done is not None:
            self._on_done(self._error)

    def wait(self, deadline: float, what: str) -> None:
        """Block until every frame is handed to the kernel; raise the first send error."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending == 0,
                                       timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"{what}: sends did not drain before the deadline")
            if self._error is not None:
                raise self._error


class Payload:
    """The payload of a frame handed to a served group's handler, not read yet: `fill(view)` copies it
    into `view`. `lend()`, set only for a frame in a shared-memory slot, returns it as a uint8 tensor
    over the slot itself, or None when no more slots may be lent (then call `fill`). A handler reads
    the payload exactly once, one way or the other."""

    __slots__ = ("fill", "lend")

    def __init__(self, fill: Callable[[memoryview], None], lend: Callable[[], torch.Tensor | None] | None) -> None:
        self.fill, self.lend = fill, lend


class Held:
    """A frame that arrived before its receive was posted, kept until it is."""

    __slots__ = ("complete", "data", "sig", "waiter")

    def __init__(self, sig: Signature, nbytes: int) -> None:
        self.sig = sig
        self.data = bytearray(nbytes)
        self.complete = False
        self.waiter: Recv | None = None

