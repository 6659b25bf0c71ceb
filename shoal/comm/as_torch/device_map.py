"""A device map that gives shoal the CPU and NCCL the GPU: `init_process_group("cpu:shoal,cuda:nccl")`.

torch builds one backend per device of the map, but a backend written in Python (a ProcessGroup, as ours
must be: torch's C++ `Backend` takes no Python subclass) replaces the whole group, so the NCCL part is
never built. The group shoal hands torch therefore builds it: at the first operation on a CUDA tensor,
from the map torch recorded for the group, and hands it every CUDA tensor from then on. NCCL connects
lazily itself (a communicator at a group's first collective, a pair's at its first send), so building it
late joins no rank to anything early."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as tdist

SHOAL = "shoal"
_BESIDE_SHOAL = {"cuda": ("nccl",)}  # the backends a device may name beside shoal on the CPU


def parse(config: str) -> dict[str, str]:
    """torch's record of a group's map ("cpu:shoal,cuda:nccl") as {device type: backend}, checked: shoal
    takes the CPU, and each other device is shoal's too or NCCL's."""
    backends = dict(entry.split(":", 1) for entry in config.lower().split(","))
    if backends.get("cpu", SHOAL) != SHOAL:
        raise ValueError(f"device map {config!r}: backend 'shoal' in a map must take the CPU "
                         f"(e.g. 'cpu:shoal,cuda:nccl'), not {backends['cpu']!r}")
    for device, backend in backends.items():
        if backend != SHOAL and backend not in _BESIDE_SHOAL.get(device, ()):
            allowed = " or ".join(repr(b) for b in (SHOAL, *_BESIDE_SHOAL.get(device, ())))
            raise ValueError(f"device map {config!r}: {device} tensors beside shoal go to {allowed}, "
                             f"not {backend!r}")
    return backends


def nccl_group(store: tdist.Store, rank: int, size: int, timeout: timedelta, ranks: list[int],
               name: str) -> tdist.ProcessGroup:
    """torch's group over NCCL alone, for this group's CUDA tensors: the same ranks, its own keys in
    the group's store."""
    if not tdist.is_nccl_available() or not torch.cuda.is_available():
        raise RuntimeError("device map 'cuda:nccl': this torch has no NCCL or this machine no GPU")
    store = tdist.PrefixStore("cuda/nccl/", store)
    options = tdist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    options.global_ranks_in_group = ranks
    options.group_name = name
    backend = tdist.ProcessGroupNCCL(store, rank, size, options)
    group = tdist.ProcessGroup(store, rank, size)
    group._set_default_backend(tdist.ProcessGroup.BackendType.NCCL)
    group._register_backend(torch.device("cuda"), tdist.ProcessGroup.BackendType.NCCL, backend)
    return group
