"""Optimizers for model-parallel training over RPC."""

from shoal.optim.distributed import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
