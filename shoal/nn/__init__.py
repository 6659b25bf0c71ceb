"""Modules for model-parallel training over RPC."""

from shoal.nn.remote_module import RemoteModule

__all__ = ["RemoteModule"]
