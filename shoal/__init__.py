"""shoal: distributed training for PyTorch, with its own communication library."""

# Distributed autograd is part of RPC as a whole: importing it installs the hook through which RPC
# records into its contexts, on every worker, whether or not the worker's own code imports it.
import shoal.autograd  # noqa: F401
from shoal.errors import CollectiveMismatchError, GroupBrokenError, PeerFailure
from shoal.parallel import DistributedDataParallel

__all__ = ["CollectiveMismatchError", "DistributedDataParallel", "GroupBrokenError", "PeerFailure"]
__version__ = "0.1.0"
