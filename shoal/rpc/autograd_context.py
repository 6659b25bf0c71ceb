"""One distributed autograd context as one worker holds it: the tensors it sent (with the graphs
that made them), the tensors it received, the gradients it accumulated, and the workers it
exchanged tensors with (whom its release must reach)."""

from __future__ import annotations

import threading

import torch

Origin = tuple[int, int, int]  # (sender's rank, its send id, the tensor's index in that message)


class Context:
    """Gradients accumulate here, never in `.grad`, so concurrent contexts over shared parameters
    (two trainers on one parameter server) stay apart."""

    def __init__(self, context_id: int) -> None:
        self.id = context_id
        self._lock = threading.Lock()
        # Keeping the sent tensors keeps their graphs: the backward through them may come at any
        # time until the context is released, and more than once.
        self._sends: dict[int, dict[int, torch.Tensor]] = {}
        self._recvs: dict[int, tuple[torch.Tensor, Origin]] = {}  # id(tensor) -> (tensor, origin)
        self._grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(tensor) -> (tensor, grad)
        self._workers: set[int] = set()

    def add_send(self, send_id: int | None, dst: int, tensors: dict[int, torch.Tensor]) -> None:
        """A message to `dst` carried `tensors` made here (none, when all it carried was forwarded)."""
        with self._lock:
            if send_id is not None:
                self._sends[send_id] = dict(tensors)
            self._workers.add(dst)

    def add_recv(self, src: int, tensors: dict[int, torch.Tensor], origins: dict[int, Origin]) -> None:
        """A message from `src` brought `tensors`, whose gradients go to `origins` (by index)."""
        with self._lock:
            for index, tensor in tensors.items():
                self._recvs[id(tensor)] = (tensor, origins[index])
                self._workers.add(origins[index][0])
            self._workers.add(src)

    def sent(self, send_id: int, index: int) -> torch.Tensor:
        """The tensor that left in send `send_id` at `index`, whose gradient just came back."""
        with self._lock:
            try:
                return self._sends[send_id][index]
            except KeyError:
                raise RuntimeError(f"distributed autograd context {self.id} has no tensor {index} in send "
                                   f"{send_id}; was the context released while its backward ran?") from None

    def origin(self, tensor: torch.Tensor) -> Origin | None:
        """Where a received tensor came from; None for a tensor made here."""
        entry = self._recvs.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None

    def accumulate(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        with self._lock:
            entry = self._grads.get(id(tensor))
            # Out of place: `grad` may be a caller's tensor (a root's), which must not change.
            self._grads[id(tensor)] = (tensor, grad if entry is None else entry[1] + grad)

    def set_gradients(self, grads: dict[torch.Tensor, torch.Tensor]) -> None:
        """Replace the gradients of these tensors (DistributedDataParallel's averages)."""
        with self._lock:
            for tensor, grad in grads.items():
                self._grads[id(tensor)] = (tensor, grad)

    def gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        with self._lock:
            return dict(self._grads.values())

    def has_sends(self) -> bool:
        with self._lock:
            return bool(self._sends)

    def workers(self) -> set[int]:
        with self._lock:
            return set(self._workers)
