"""Optimizers for distributed training: DistributedOptimizer (model parallelism over RPC), PostLocalSGDOptimizer
(local SGD with periodic model averaging), DiLoCoOptimizer (an outer optimizer over averaged local progress),
ZeroRedundancyOptimizer (optimizer state sharded across ranks), and
functional optimizers stepped with given gradients."""

from shoal.optim.diloco import DiLoCoOptimizer
from shoal.optim.distributed import DistributedOptimizer
from shoal.optim.functional import as_functional_optim
from shoal.optim.post_local_sgd import PostLocalSGDOptimizer
from shoal.optim.zero import ZeroRedundancyOptimizer

__all__ = ["DiLoCoOptimizer", "DistributedOptimizer", "PostLocalSGDOptimizer", "ZeroRedundancyOptimizer",
           "as_functional_optim"]
