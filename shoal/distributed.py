"""`import shoal.distributed as dist`: the torch.distributed-style API of shoal's communication library."""

from shoal.comm import *  # noqa: F403 - this module is the public re-export of shoal.comm
from shoal.comm import __all__  # noqa: F401
