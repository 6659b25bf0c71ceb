"""shoal: distributed training for PyTorch, with its own communication library."""

from shoal.errors import CollectiveMismatchError, GroupBrokenError, PeerFailure
from shoal.parallel import DistributedDataParallel

__all__ = ["CollectiveMismatchError", "DistributedDataParallel", "GroupBrokenError", "PeerFailure"]
__version__ = "0.1.0"
