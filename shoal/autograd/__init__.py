"""Distributed autograd (`from shoal import autograd as dist_autograd`): gradients that flow back
across RPC boundaries, accumulated per context."""

from shoal.autograd.api import backward, context, get_gradients

__all__ = ["backward", "context", "get_gradients"]
