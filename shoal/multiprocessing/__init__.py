"""torch.multiprocessing's job: Python's multiprocessing, with tensors that travel through shared memory.

    import shoal.multiprocessing as mp
    mp.spawn(train, args=(world_size,), nprocs=world_size)

Importing this package makes every multiprocessing queue, pipe and process argument in this
process send CPU tensors through shared memory (`reductions.py`); the rest of multiprocessing's
names are here unchanged, as torch.multiprocessing re-exports them.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing import *  # noqa: F403  (the drop-in: every name multiprocessing has)

from shoal.multiprocessing import reductions
from shoal.multiprocessing.spawn import (
    ProcessContext,
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    spawn,
    start_processes,
)

reductions.install()

_STRATEGY = "file_descriptor"


def get_all_sharing_strategies() -> set[str]:
    """Tensors are shared as anonymous memory files passed by descriptor, torch's "file_descriptor" way."""
    return {_STRATEGY}


def get_sharing_strategy() -> str:
    return _STRATEGY


def set_sharing_strategy(new_strategy: str) -> None:
    if new_strategy != _STRATEGY:
        raise ValueError(f"sharing strategy {new_strategy!r} is not offered: shoal shares tensors as anonymous memory "
                         f"files passed by descriptor ({_STRATEGY!r}), which leave nothing behind in /dev/shm")


__all__ = [
    *multiprocessing.__all__,
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "get_all_sharing_strategies",
    "get_sharing_strategy",
    "set_sharing_strategy",
    "spawn",
    "start_processes",
]
