"""The distributed autograd contexts on this worker, which RPC records into as its messages come and go
(as torch keeps its autograd context container in its RPC layer): which context the calling thread is
in, and what each message in a context sent or received. `shoal.autograd` runs the distributed backward
over these records; the agent tells them when it starts and stops and when a worker dies."""

from __future__ import annotations

import collections
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from shoal.rpc.agent.pool import WorkerPool
from shoal.rpc.autograd_context import Context
from shoal.rpc.headers import AutogradTag
from shoal.rpc.message import Encoded

_ORIGIN_SHIFT = 48  # a context id is (originating rank << 48) | a number: unique across the job


def originator(context_id: int) -> int:
    """The rank whose `context()` made this id."""
    return context_id >> _ORIGIN_SHIFT


def _passes_thread() -> WorkerPool:
    """The one thread that runs the passes of distributed backwards on this worker, those other workers
    ask of it and its own (autograd/engine.py says why), as torch's engine has one: the gradients they
    make (25 MB for an embedding table) come from one malloc arena, which reuses their memory step
    after step instead of faulting in fresh pages. The price is torch's too: passes run one at a time,
    so a pass that blocks (a custom autograd Function making an RPC whose answer needs another pass
    here) waits out its timeout."""
    return WorkerPool(1, "shoal-autograd-passes")


class ContextRegistry:
    """Every distributed autograd context this worker takes part in, by id."""

    def __init__(self) -> None:
        self._numbers = itertools.count()
        self._send_ids = itertools.count()
        self._thread = threading.local()
        self._failure_listeners: list[Callable[[int], None]] = []
        self.forget()

    def forget(self) -> None:
        """No contexts, and a passes thread still to start: at import, and in a forked child, whose parent's
        lock may be held for good and whose passes thread is gone (nothing here is shut down: the objects
        are the parent's)."""
        self._lock = threading.Lock()
        self._contexts: dict[int, Context] = {}
        self._dead: set[int] = set()
        # The last contexts released here, so that a late message cannot recreate one (bounded:
        # a message later than this many releases would find it gone and recreate it).
        self._released: collections.deque[int] = collections.deque(maxlen=65536)
        self._released_ids: set[int] = set()
        self._rank: int | None = None
        self.passes = _passes_thread()

    def when_peer_fails(self, listener: Callable[[int], None]) -> None:
        """Call `listener(rank)` after a worker's death has ended its contexts here."""
        self._failure_listeners.append(listener)

    def started(self, rank: int) -> None:
        """An RPC agent started as `rank`: contexts of an earlier one are gone."""
        with self._lock:
            self._rank = rank
            self._contexts.clear()
            self._dead.clear()
            self._released.clear()
            self._released_ids.clear()
            self.passes.shutdown()
            self.passes = _passes_thread()

    def stopped(self, deadline: float | None) -> None:
        """The RPC agent is shutting down: end the passes thread, waiting for a pass in progress until the
        monotonic `deadline` (not at all without one)."""
        self.passes.shutdown()
        if deadline is not None:
            self.passes.join(deadline)

    # ---- contexts ----------------------------------------------------------------------------

    def create(self, rank: int) -> Context:
        context = Context(rank << _ORIGIN_SHIFT | next(self._numbers))
        with self._lock:
            self._contexts[context.id] = context
        return context

    def get(self, context_id: int) -> Context:
        with self._lock:
            context = self._contexts.get(context_id)
        if context is None:
            raise RuntimeError(f"no distributed autograd context {context_id} on this worker: it was never "
                               f"entered here, or it was released (contexts end when their `with` block ends)")
        return context

    def pop(self, context_id: int) -> Context | None:
        """End a context here; a message for it that arrives late will not bring it back."""
        with self._lock:
            if len(self._released) == self._released.maxlen:
                self._released_ids.discard(self._released[0])
            self._released.append(context_id)
            self._released_ids.add(context_id)
            return self._contexts.pop(context_id, None)

    def _get_or_create(self, context_id: int) -> Context:
        with self._lock:
            if originator(context_id) in self._dead:
                raise RuntimeError(f"distributed autograd context {context_id} ended with its worker "
                                   f"(rank {originator(context_id)}), which died")
            if context_id in self._released_ids:
                raise RuntimeError(f"distributed autograd context {context_id} was released here already; "
                                   f"a call made in it finished after its `with` block ended")
            context = self._contexts.get(context_id)
            if context is None:
                context = self._contexts[context_id] = Context(context_id)
            return context

    def __len__(self) -> int:
        with self._lock:
            return len(self._contexts)

    # ---- the calling thread's context --------------------------------------------------------

    def current_context(self) -> int | None:
        """The id of the context the calling thread is in, if any."""
        return getattr(self._thread, "context_id", None)

    @contextmanager
    def serving(self, context_id: int | None) -> Iterator[None]:
        """Run a served call (or its nested calls) in the caller's context."""
        outer = self.current_context()
        self._thread.context_id = context_id
        try:
            yield
        finally:
            self._thread.context_id = outer

    # ---- what RPC tells us -------------------------------------------------------------------

    def record_send(self, context_id: int, dst: int, tensors: dict[int, torch.Tensor]) -> AutogradTag:
        """Tensors (by their index in a message) leave for `dst`; returns the tag the message carries,
        which says where their gradients are to go."""
        context = self._get_or_create(context_id)
        made_here, forwarded = {}, []
        for index, tensor in tensors.items():
            origin = context.origin(tensor)
            if origin is None:
                made_here[index] = tensor
            else:  # received and passed on unchanged: this worker would only relay its gradient
                forwarded.append((index, *origin))
        send_id = next(self._send_ids) if made_here else None
        context.add_send(send_id, dst, made_here)
        return AutogradTag(context_id, send_id, tuple(forwarded))

    def record_recv(self, src: int, tag: AutogradTag, tensors: dict[int, torch.Tensor]) -> None:
        """Tensors (by their index in the message) arrived from `src` in a message tagged `tag`."""
        forwarded = {index: (rank, send_id, at) for index, rank, send_id, at in tag.forwarded}
        origins = {index: forwarded.get(index, (src, tag.send_id, index)) for index in tensors}
        self._get_or_create(tag.context_id).add_recv(src, tensors, origins)

    def peer_failed(self, rank: int) -> None:
        """A dead worker's contexts are over; so are those only it could still release."""
        with self._lock:
            self._dead.add(rank)
            for context_id, context in list(self._contexts.items()):
                others = context.workers()
                orphaned = others and others <= self._dead and originator(context_id) != self._rank
                if originator(context_id) == rank or orphaned:
                    del self._contexts[context_id]
        for listener in self._failure_listeners:
            listener(rank)


contexts = ContextRegistry()
os.register_at_fork(after_in_child=contexts.forget)


# ---- what the agent calls with each message ----------------------------------------------------------

def outgoing_tag(dst: int, payload: Encoded | None, context_id: int | None) -> AutogradTag | None:
    """The tag a message in `context_id` carries. Every such message is recorded, with or without
    tensors that require grad: its receiver joins the context (it runs the call in it, and may
    record sends of its own), and so must be told when the context ends."""
    if context_id is None:
        return None
    return contexts.record_send(context_id, dst, payload.grad_tensors if payload is not None else {})


def record_arrival(src: int, tag: AutogradTag | None, grad_tensors: dict[int, torch.Tensor]) -> None:
    if tag is not None:
        contexts.record_recv(src, tag, grad_tensors)


def serving(tag: AutogradTag | None) -> AbstractContextManager[None]:
    """Run a served call in the context its message came from."""
    return contexts.serving(tag.context_id) if tag is not None else nullcontext()
