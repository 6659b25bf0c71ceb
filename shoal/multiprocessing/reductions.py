"""Tensors cross process boundaries through shared memory: pickling one sends a descriptor, never its bytes.

A CPU tensor's storage is moved into an anonymous memory file (memfd) the first time it is sent,
in place, so the sender's tensor and all its views keep working and now share memory with every
process that receives it: a write on either side is seen by the other with no copy. The receiver
maps the file it is handed (multiprocessing passes descriptors over a Unix socket, or to a child
being spawned) and keeps the descriptor only as long as the storage lives, so it can pass the
tensor on. A memfd has no name in any file system: when the last process that maps it dies, even
by SIGKILL in the middle of a transfer, the memory is gone and nothing is left in /dev/shm.

Storages torch itself has already put in shared memory (`tensor.share_memory_()`,
`module.share_memory()`) are sent by the descriptor torch keeps for them, so processes that map
them already stay in step. Tensors this file does not handle (CUDA, sparse, quantized, conjugate
views) go through torch.multiprocessing's reducers.
"""

from __future__ import annotations

import os
import threading
import weakref
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import Any

import torch
from torch.multiprocessing import reductions as torch_reductions

from shoal.forks import renew_locks_in_child

_FD = "_shoal_memfd"  # attribute of a storage this process maps from a memfd: the file's descriptor
_moving = threading.Lock()
renew_locks_in_child(globals(), "_moving")


def _map(fd: int, nbytes: int) -> torch.UntypedStorage:
    return torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)


def _own(storage: torch.UntypedStorage, fd: int) -> torch.UntypedStorage:
    """Keep the memfd `fd` behind `storage` open as long as the storage lives, to send it on."""
    setattr(storage, _FD, fd)
    weakref.finalize(storage, os.close, fd)
    return storage


def _descriptor(storage: torch.UntypedStorage) -> int:
    """The descriptor of the shared memory behind `storage`, moving it there first if it is private."""
    with _moving:  # queues pickle on threads of their own: one storage sent to two must move once
        return _descriptor_locked(storage)


def _descriptor_locked(storage: torch.UntypedStorage) -> int:
    fd = getattr(storage, _FD, None)
    if fd is not None:
        return fd
    if storage.is_shared():  # torch's own shared memory: other processes may map it already
        fd, _ = storage._share_fd_cpu_()
        return fd
    fd = os.memfd_create("shoal-tensor", os.MFD_CLOEXEC)
    try:
        # Where memory is short, the mapping or the copy fails: the storage stays as it was.
        os.ftruncate(fd, storage.nbytes())
        shared = _map(fd, storage.nbytes())
        shared.copy_(storage)
        # Swap the memory under the storage itself, not under one tensor, so that every view follows;
        # `shared` is left holding the private memory and frees it.
        storage._swap_data_ptr_(shared)
    except BaseException:
        os.close(fd)
        raise
    _own(storage, fd)
    return fd


def _rebuild_storage(handle: Any, nbytes: int) -> torch.UntypedStorage:
    fd = handle.detach()
    try:
        shared = _map(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return _own(shared, fd)


def reduce_storage(storage: torch.UntypedStorage) -> tuple:
    if storage.device.type != "cpu":
        return torch_reductions.reduce_storage(storage)
    if storage.nbytes() == 0:  # nothing to share, and an empty file cannot be mapped
        return torch.UntypedStorage, (0,)
    return _rebuild_storage, (DupFd(_descriptor(storage)), storage.nbytes())


def _rebuild_tensor(cls: type, storage: torch.UntypedStorage, dtype: torch.dtype, offset: int,
                    size: torch.Size, stride: tuple[int, ...], requires_grad: bool) -> torch.Tensor:
    tensor = torch.empty((0,), dtype=dtype).set_(storage, offset, size, stride)
    if cls is torch.nn.Parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


def reduce_tensor(tensor: torch.Tensor) -> tuple:
    if (tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized
            or tensor.is_conj() or tensor.is_neg()):
        return torch_reductions.reduce_tensor(tensor)
    if tensor.requires_grad and not tensor.is_leaf:
        raise RuntimeError("a tensor that requires grad and is not a leaf cannot be sent to another process: "
                           "its graph cannot follow it. Send tensor.detach(), or make it a leaf.")
    # The storage is pickled as an object of its own, so views of one storage in a message share it.
    return _rebuild_tensor, (type(tensor), tensor.untyped_storage(), tensor.dtype, tensor.storage_offset(),
                             tensor.size(), tensor.stride(), tensor.requires_grad)


def install() -> None:
    """Make every multiprocessing pickler in this process (queues, pipes, process arguments) use these reducers."""
    ForkingPickler.register(torch.Tensor, reduce_tensor)
    ForkingPickler.register(torch.nn.Parameter, reduce_tensor)
    ForkingPickler.register(torch.UntypedStorage, reduce_storage)
