"""This process's RPC agent, in a module of its own so that RRefs, proxies and the user-facing
functions can find it without importing the agent's package (and it theirs)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from shoal.forks import refuse_in_child

if TYPE_CHECKING:
    from shoal.rpc.agent import RpcAgent

_current: RpcAgent | None = None
_forked_from: int | None = None  # in a forked child: the parent's pid, if RPC ran there


def current_agent() -> RpcAgent:
    """The agent `init_rpc` started; RuntimeError before init_rpc or after shutdown."""
    if _current is None:
        if _forked_from is not None:
            refuse_in_child(_forked_from, "the RPC agent", "call shoal.rpc.init_rpc() in this process")
        raise RuntimeError("RPC is not initialized on this worker; call shoal.rpc.init_rpc() first")
    return _current


def _forget_in_child() -> None:
    """A forked child holds its parent's agent without the threads that run it: it starts with none, free
    to init_rpc as a worker of its own."""
    global _current, _forked_from
    if _current is not None:
        _current, _forked_from = None, os.getppid()


os.register_at_fork(after_in_child=_forget_in_child)


def current_or_none() -> RpcAgent | None:
    return _current


def set_current(agent: RpcAgent | None) -> None:
    global _current, _forked_from
    _current, _forked_from = agent, None
