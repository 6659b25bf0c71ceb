"""shoal: distributed training for PyTorch, with its own communication library."""

from shoal.errors import CollectiveMismatchError, GroupBrokenError, PeerFailure

__all__ = ["CollectiveMismatchError", "GroupBrokenError", "PeerFailure"]
__version__ = "0.1.0"
