"""The backends by name, and how a world group of each is built from a joined store: the one place that
chooses a backend, for `init_process_group` and for the groups a live membership builds per generation."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from shoal.comm.backends.c10d import C10dProcessGroup
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.backends.native import ShoalProcessGroup
from shoal.comm.store import Store

# (store, rank, world_size, timeout, the store's host, toward which ranks listen: rendezvous.listen_addresses)
_BUILDERS: dict[str, Callable[[Store, int, int, timedelta, str], ProcessGroup]] = {
    "shoal": ShoalProcessGroup.create,
    "gloo": lambda store, rank, size, timeout, host: C10dProcessGroup.create("gloo", store, rank, size, timeout),
    "nccl": lambda store, rank, size, timeout, host: C10dProcessGroup.create("nccl", store, rank, size, timeout),
}
BACKENDS = tuple(sorted(_BUILDERS))


def check_backend(backend: str) -> str:
    if backend not in _BUILDERS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    return backend


def world_group(backend: str, store: Store, rank: int, world_size: int, timeout: timedelta,
                store_host: str) -> ProcessGroup:
    """The group of all `world_size` ranks, connected through `store` (which every rank has joined)."""
    return _BUILDERS[check_backend(backend)](store, rank, world_size, timeout, store_host)
