"""The hook every layer reports what it does through: spans (a collective, a forward, an RPC call),
instants (a failure, a new generation) and flows (a send and the receive it pairs with).

It imports nothing of shoal's, so the communication layer can emit events without depending on what
consumes them. Consumers are sinks (a timeline file, a metrics writer); with none attached, which is
the default, every emit returns at its first test and records nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

# Categories that the tools after a run add up: time computing, and time communicating.
COMPUTE = "compute"
COMM = "comm"
RPC = "rpc"
COMMUNICATING = frozenset({COMM, RPC})
DDP = "ddp"
# Rare events that a post-mortem needs: sinks write them out at once.
FAULT = "fault"
MEMBERSHIP = "membership"

# The name the collectives issued in a `record_comm` block are known by: their spans carry it as "label".
comm_label: contextvars.ContextVar[str | None] = contextvars.ContextVar("comm_label", default=None)

Started = tuple[int, int]  # (time from `now()`, native id of the thread the span is drawn on)


class Sink(Protocol):
    """Where events go; called on whichever thread emits them, so implementations must be thread-safe."""

    def complete(self, name: str, cat: str, start_ns: int, end_ns: int, tid: int, args: dict[str, Any]) -> None: ...

    def instant(self, name: str, cat: str, ts_ns: int, tid: int, args: dict[str, Any]) -> None: ...

    def flow(self, begins: bool, flow_id: int, ts_ns: int, tid: int) -> None: ...

    def process(self, rank: int | None, clock_offset_ns: int | None) -> None:
        """Facts about this process learnt after it started: its rank, its clock's offset to rank 0's."""


_sinks: tuple[Sink, ...] = ()
_lock = threading.Lock()


def _forget_sinks_in_child() -> None:
    """A forked child (a DataLoader worker, say) starts with no sinks: they write the parent's files.
    No lock is taken: another thread of the parent may have held it at the fork."""
    global _sinks, _lock
    _sinks, _lock = (), threading.Lock()


os.register_at_fork(after_in_child=_forget_sinks_in_child)


_WALL_MINUS_EVENT_CLOCK = time.time_ns() - time.perf_counter_ns()


def now() -> int:
    """This process's event clock, in nanoseconds: monotonic, so spans never run backwards."""
    return time.perf_counter_ns()


def wall_ns(event_ns: int | None = None) -> int:
    """An event-clock time (default: now) as wall-clock nanoseconds since the epoch, by this process's
    wall clock when it started."""
    return (time.perf_counter_ns() if event_ns is None else event_ns) + _WALL_MINUS_EVENT_CLOCK


def active() -> bool:
    """Whether anything consumes events."""
    return bool(_sinks)


def attach(sink: Sink) -> None:
    global _sinks
    with _lock:
        if sink not in _sinks:
            _sinks = (*_sinks, sink)
        _time_optimizer_steps()


_optimizer_hooks: tuple | None = None


def _time_optimizer_steps() -> None:
    """Every torch.optim optimizer's step becomes a compute span, through torch's global step hooks
    (installed with the first sink, once; they do nothing while no sink is attached)."""
    global _optimizer_hooks
    if _optimizer_hooks is not None:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    stepping = threading.local()

    def before(optimizer: object, args: object, kwargs: object) -> None:
        stepping.started = begin()

    def after(optimizer: object, args: object, kwargs: object) -> None:
        complete(f"{type(optimizer).__name__}.step", COMPUTE, getattr(stepping, "started", None))
        stepping.started = None

    _optimizer_hooks = (register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after))


def detach(sink: Sink) -> None:
    global _sinks
    with _lock:
        _sinks = tuple(s for s in _sinks if s is not sink)


def describe_process(rank: int | None = None, clock_offset_ns: int | None = None) -> None:
    for sink in _sinks:
        sink.process(rank, clock_offset_ns)


def begin() -> Started | None:
    """Mark the start of a span that `complete` ends, maybe on another thread; None when nothing
    consumes events, so that an emitter can skip its own bookkeeping."""
    return (time.perf_counter_ns(), threading.get_native_id()) if _sinks else None


def complete(name: str, cat: str, started: Started | None, **args: Any) -> None:
    """The span from `started` to now, drawn on the thread that began it."""
    sinks = _sinks
    if started is None or not sinks:
        return
    end = time.perf_counter_ns()
    for sink in sinks:
        sink.complete(name, cat, started[0], end, started[1], args)


@contextlib.contextmanager
def _span(name: str, cat: str, args: dict[str, Any]) -> Iterator[dict[str, Any]]:
    started = begin()
    try:
        yield args
    finally:
        complete(name, cat, started, **args)


def span(name: str, cat: str, **args: Any) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """`with span(...) as args:` records the block; the body may add to `args`."""
    return _span(name, cat, args) if _sinks else contextlib.nullcontext(args)


def instant(name: str, cat: str, **args: Any) -> None:
    sinks = _sinks
    if not sinks:
        return
    ts, tid = time.perf_counter_ns(), threading.get_native_id()
    for sink in sinks:
        sink.instant(name, cat, ts, tid, args)


def flow(begins: bool, flow_id: int, at: Started | None) -> None:
    """One end of an arrow between two spans, possibly in two processes: the start where the sending
    span starts (`at` is its `begin()`), the end just before the receiving span ends (`at` is that
    span's start; the end is taken now). Both ends carry the same `flow_id`."""
    sinks = _sinks
    if at is None or not sinks:
        return
    ts = at[0] if begins else max(at[0], time.perf_counter_ns() - 1000)
    for sink in sinks:
        sink.flow(begins, flow_id, ts, at[1])
