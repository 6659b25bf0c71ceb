"""What a rank does once its world group is up, whichever API built it (shoal's init_process_group, or
torch's with backend "shoal"): name its rank to the flight recorder and the timeline, dump the flight
record on SIGUSR1, and, where every rank traces, line its trace up with rank 0's clock."""

from __future__ import annotations

import torch

from shoal.comm import clock
from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.backends.group import ProcessGroup
from shoal.observe import events, flight
from shoal.observe.flight import recorder


def observe(world: ProcessGroup) -> None:
    """Collective: every rank of `world` calls it once the group is up (NCCL groups: clocks not measured)."""
    recorder.rank = world.ranks[world.rank]
    flight.dump_on_sigusr1()
    if world.backend == "nccl":  # its tensors must be on the rank's GPU, which it may not have chosen yet
        events.describe_process(rank=recorder.rank)
        return
    tracing = torch.tensor([1 if events.active() else 0], dtype=torch.int32)
    world.all_reduce(tracing, ReduceOp.MIN).wait()
    offset = clock.offset_to_rank0(world) if tracing.item() else None
    events.describe_process(rank=recorder.rank, clock_offset_ns=offset)
