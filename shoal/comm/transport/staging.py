"""Communicating a tensor that is not laid out for it (non-contiguous, or on another device) through a
contiguous staging copy, and copying the result back; tensors that are already right are used in place."""

from __future__ import annotations

from collections.abc import Callable

import torch


def staged(tensor: torch.Tensor, device: str | None = None) -> tuple[torch.Tensor, Callable[[], None]]:
    """`tensor` as a contiguous tensor on `device` (its own when None), and how to copy results back."""
    if tensor.is_contiguous() and (device is None or tensor.device.type == device):
        return tensor, lambda: None
    copy = tensor.detach().to(device or tensor.device, copy=True).contiguous()
    # Detached: writing a result into a parameter is no step autograd should see, and the copy back may
    # run on a thread outside the caller's no_grad.
    return copy, lambda: tensor.detach().copy_(copy)


def staged_flat(tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """`staged` on the CPU, flattened: what frames are sent from and received into."""
    copy, back = staged(tensor, "cpu")
    return copy.view(-1), back
