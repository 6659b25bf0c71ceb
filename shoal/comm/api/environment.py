"""What a script asks of its surroundings: which backends exist here, how the process was launched, and
the debugging aids (a breakpoint on one rank, names for collectives in a timeline), as torch.distributed
spells them."""

from __future__ import annotations

import collections
import contextlib
import logging
import pdb
import sys
import traceback
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as tdist

from shoal import config
from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.api.collectives import barrier
from shoal.comm.api.world import get_rank
from shoal.comm.backends.registry import BACKENDS
from shoal.observe import events

log = logging.getLogger("shoal.distributed")  # torch's `dist.log`: where the distributed layer logs


def is_available() -> bool:
    """Whether the distributed package is usable here: shoal's backend always is."""
    return True


def is_backend_available(backend: str) -> bool:
    """Whether `init_process_group` can run `backend` here: "shoal" always, "gloo" where torch has it,
    "nccl" where torch has it and GPUs are present."""
    name = str(backend).lower()
    if name == "gloo":
        return is_gloo_available()
    if name == "nccl":
        return is_nccl_available() and torch.cuda.is_available()
    return name in BACKENDS


def is_gloo_available() -> bool:
    """Whether backend "gloo" (torch's engine, which shoal delegates to) is built into this torch."""
    return tdist.is_gloo_available()


def is_nccl_available() -> bool:
    """Whether backend "nccl" (torch's engine, which shoal delegates to) is built into this torch."""
    return tdist.is_nccl_available()


def is_mpi_available() -> bool:
    """shoal runs no MPI backend."""
    return False


def is_ucc_available() -> bool:
    """shoal runs no UCC backend."""
    return False


def is_xccl_available() -> bool:
    """shoal runs no XCCL (Intel GPU) backend."""
    return False


def get_default_backend_for_device(device: str | torch.device) -> str:
    """The backend `init_process_group` would pick for tensors on `device`: shoal's own for CPUs, NCCL
    for GPUs."""
    kind = torch.device(device).type
    if kind == "cpu":
        return "shoal"
    if kind == "cuda":
        return "nccl"
    raise ValueError(f"no shoal backend runs tensors on {kind!r} devices (cpu: shoal, cuda: nccl)")


_NO_COMPLEX = (ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def supports_complex(reduceOp: ReduceOp) -> bool:
    """Whether `reduceOp` is defined on complex tensors (an order or bits: not)."""
    return ReduceOp(reduceOp) not in _NO_COMPLEX


def is_torchelastic_launched() -> bool:
    """Whether a launcher (`shoal run`, torchrun) started this process: it gives workers the job's id."""
    return config.TORCHELASTIC_RUN_ID.get() is not None


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This worker's rank on its host (LOCAL_RANK, which the launcher sets), else `fallback_rank`."""
    local = config.LOCAL_RANK.get()
    if local is not None:
        return local
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError("LOCAL_RANK is not set (a launcher such as `shoal run` sets it); pass fallback_rank= to "
                       "run without one")


# Calls of `breakpoint(skip=...)` seen so far, by where they were called from.
_breakpoints_seen: collections.Counter[str] = collections.Counter()


def breakpoint(rank: int = 0, skip: int = 0, timeout_s: float = 3600) -> None:
    """Stop in pdb on `rank` (after skipping its first `skip` calls from this place); the other ranks wait
    in a barrier, up to `timeout_s`, until it goes on."""
    if skip > 0:
        where = "".join(traceback.format_stack(limit=2)[:1])
        _breakpoints_seen[where] += 1
        if _breakpoints_seen[where] <= skip:
            return
    if get_rank() == rank:
        debugger = pdb.Pdb(stdin=open("/dev/stdin") if not sys.stdin.isatty() else sys.stdin)
        debugger.message(f"shoal.distributed.breakpoint(rank={rank}): type 'up' to reach the caller")
        debugger.set_trace()
    barrier(timeout=timedelta(seconds=timeout_s))


@contextlib.contextmanager
def record_comm(name: str) -> Iterator[None]:
    """Give the collectives issued in this block `name`: their spans on the timeline carry it (as torch's
    profiler titles them by it)."""
    token = events.comm_label.set(name)
    try:
        yield
    finally:
        events.comm_label.reset(token)
