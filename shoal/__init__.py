"""shoal: distributed training for PyTorch, with its own communication library. Importing it starts
nothing: it registers backend "shoal" with torch.distributed, and a job begins with `init_process_group`
(shoal's or torch's), `init_rpc` or `shoal run`."""

from shoal.comm import as_torch
from shoal.errors import CollectiveMismatchError, GroupBrokenError, PeerFailure
from shoal.parallel import DistributedDataParallel

__all__ = ["CollectiveMismatchError", "DistributedDataParallel", "GroupBrokenError", "PeerFailure"]
__version__ = "0.1.0"

as_torch.register()
