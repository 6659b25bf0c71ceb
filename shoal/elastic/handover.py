"""Handing training state from a generation's rank 0 to every member over the group's transport, so
that a worker that joins (restarted, or new) starts from the state the others hold, not from disk."""

from __future__ import annotations

import io
from typing import Any

import torch

from shoal.comm.backends.group import ProcessGroup
from shoal.comm.objects import broadcast_object_list


def share_state(group: ProcessGroup, state: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's `state` (tensors, containers and plain values, as optimizers' state dicts hold), on every
    rank of `group`: rank 0 passes it, the others None. It travels as `torch.save` bytes, loaded with
    weights_only, as a checkpoint would be."""
    if group.rank == 0:
        if state is None:
            raise ValueError("share_state: rank 0 must pass the state to share")
        buffer = io.BytesIO()
        torch.save(state, buffer)
        saved = [buffer.getvalue()]
    else:
        saved = [None]
    broadcast_object_list(group, saved, group.ranks[0])
    if group.rank == 0:
        return state
    # On the CPU: load_state_dict moves optimizer state to its parameters' device, wherever rank 0's was.
    return torch.load(io.BytesIO(saved[0]), map_location="cpu", weights_only=True)
