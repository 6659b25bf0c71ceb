"""Handing training state from a generation's rank 0 to every member over the group's transport, so
that a worker that joins (restarted, or new) starts from the state the others hold, not from disk."""

from __future__ import annotations

import io
from typing import Any

import torch

from shoal.comm.backends.group import ProcessGroup


def share_state(group: ProcessGroup, state: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's `state` (tensors, containers and plain values, as optimizers' state dicts hold), on every
    rank of `group`: rank 0 passes it, the others None."""
    root = group.ranks[0]
    if group.rank == 0:
        if state is None:
            raise ValueError("share_state: rank 0 must pass the state to share")
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(group.device)
        length = torch.tensor([payload.numel()], dtype=torch.int64, device=group.device)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=group.device)
    group.broadcast(length, root).wait()
    if group.rank != 0:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
    group.broadcast(payload, root).wait()
    if group.rank == 0:
        return state
    # On the CPU: load_state_dict moves optimizer state to its parameters' device, wherever rank 0's was.
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)
