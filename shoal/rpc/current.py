"""This process's RPC agent, in a module of its own so that RRefs, proxies and the user-facing
functions can find it without importing the agent's package (and it theirs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.rpc.agent import RpcAgent

_current: RpcAgent | None = None


def current_agent() -> RpcAgent:
    """The agent `init_rpc` started; RuntimeError before init_rpc or after shutdown."""
    if _current is None:
        raise RuntimeError("RPC is not initialized on this worker; call shoal.rpc.init_rpc() first")
    return _current


def current_or_none() -> RpcAgent | None:
    return _current


def set_current(agent: RpcAgent | None) -> None:
    global _current
    _current = agent
