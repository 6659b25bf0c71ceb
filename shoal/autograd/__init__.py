"""Distributed autograd (`from shoal import autograd as dist_autograd`): gradients that flow back
across RPC boundaries, accumulated per context."""

from shoal.autograd.api import backward, context, get_gradients


def is_available() -> bool:
    """Whether distributed autograd is usable here (torch's question): with shoal it always is."""
    return True


__all__ = ["backward", "context", "get_gradients", "is_available"]
