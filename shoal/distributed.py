"""`import shoal.distributed as dist`: torch.distributed's names over shoal's communication library."""

from shoal.comm.api import *  # noqa: F403 - this module is the public face of shoal.comm.api
from shoal.comm.api import __all__ as _api
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.backends.work import Work

__all__ = ["ProcessGroup", "Work", *_api]
