"""shoal: distributed training for PyTorch, with its own communication library. Importing it starts
nothing and installs nothing: a job begins with `init_process_group`, `init_rpc` or `shoal run`."""

from shoal.errors import CollectiveMismatchError, GroupBrokenError, PeerFailure
from shoal.parallel import DistributedDataParallel

__all__ = ["CollectiveMismatchError", "DistributedDataParallel", "GroupBrokenError", "PeerFailure"]
__version__ = "0.1.0"
