"""The seam through which distributed autograd, a layer above RPC, sees RPC's messages: the agent
asks it which context the calling thread is in, tells it which tensors that require grad leave or
arrive in a context, and runs served calls inside their caller's context. `shoal.autograd`
installs the one implementation when it is imported (importing `shoal` does so)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext

import torch

from shoal.rpc.headers import AutogradTag
from shoal.rpc.message import Encoded


class AutogradHook(ABC):
    @abstractmethod
    def started(self, rank: int) -> None:
        """An RPC agent started as `rank`: contexts of an earlier one are gone."""

    @abstractmethod
    def stopped(self, deadline: float | None) -> None:
        """The RPC agent is shutting down: end the threads started for it, waiting for work in
        progress until the monotonic `deadline` (not at all without one)."""

    @abstractmethod
    def current_context(self) -> int | None:
        """The id of the context the calling thread is in, if any."""

    @abstractmethod
    def record_send(self, context_id: int, dst: int, tensors: dict[int, torch.Tensor]) -> AutogradTag:
        """Tensors (by their index in a message) leave for `dst`; returns the tag the message
        carries, which says where their gradients are to go."""

    @abstractmethod
    def record_recv(self, src: int, tag: AutogradTag, tensors: dict[int, torch.Tensor]) -> None:
        """Tensors (by their index in the message) arrived from `src` in a message tagged `tag`."""

    @abstractmethod
    def serving(self, context_id: int | None) -> AbstractContextManager[None]:
        """Run a served call (or its nested calls) in the caller's context."""

    @abstractmethod
    def peer_failed(self, rank: int) -> None:
        """A worker died: its contexts are over everywhere."""


_hook: AutogradHook | None = None


def install(hook: AutogradHook) -> None:
    global _hook
    _hook = hook


def installed() -> AutogradHook | None:
    return _hook


# ---- what the agent calls: each a no-op while no hook is installed --------------------------------

def current_context() -> int | None:
    return _hook.current_context() if _hook is not None else None


def outgoing_tag(dst: int, payload: Encoded | None, context_id: int | None) -> AutogradTag | None:
    """The tag a message in `context_id` carries. Every such message is recorded, with or without
    tensors that require grad: its receiver joins the context (it runs the call in it, and may
    record sends of its own), and so must be told when the context ends."""
    if context_id is None:
        return None
    if _hook is None:
        return AutogradTag(context_id)
    return _hook.record_send(context_id, dst, payload.grad_tensors if payload is not None else {})


def record_arrival(src: int, tag: AutogradTag | None, grad_tensors: dict[int, torch.Tensor]) -> None:
    if tag is not None and _hook is not None:
        _hook.record_recv(src, tag, grad_tensors)


def serving(tag: AutogradTag | None) -> AbstractContextManager[None]:
    """Run a served call in the context its message came from."""
    return _hook.serving(tag.context_id) if tag is not None and _hook is not None else nullcontext()
