"""Shared-memory lanes between ranks on one host: large frames skip the kernel's socket copies.

The sender copies a frame's payload into a free slot of its outbound region and sends only the
header over the (authenticated) TCP connection; the receiver copies the slot into the posted
buffer and marks the slot free again in the region's flag bytes (the sender alone marks slots
busy, the receiver alone marks them free). A sender that finds no free slot sends over TCP
instead, so nothing ever waits for the peer.

A region is anonymous memory (memfd): it has no name in any file system, so nothing can be left
behind when a process dies. The creator announces `pid:fd:token` over the authenticated
connection; the peer opens /proc/PID/fd/FD (possible only on the same host, for the same user) and
checks the random token written at the region's start, so a same-numbered descriptor on another
host is never mistaken for it. Once the peer has mapped it, the creator closes its descriptor.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import weakref

import numpy
import torch

SLOT_BYTES = 2 << 20  # one ring chunk (ring.CHUNK_BYTES) per slot
SLOTS = 16
LENDABLE_SLOTS = SLOTS // 2  # slots a receiver may keep as tensors at once (`Inbound.lend`)
_TOKEN = slice(SLOTS, SLOTS + 16)  # after the flag bytes: the region's random identity
_FLAGS = 4096  # one byte per slot (1: holds a frame not yet taken) and the token, padded to a page
_SIZE = _FLAGS + SLOTS * SLOT_BYTES


def _copy(dst: memoryview, src: memoryview) -> None:
    # torch's copy releases the GIL, so reader and sender threads copy in parallel.
    torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))


def available() -> bool:
    """Whether to offer lanes: the platform has memfd and /proc (Linux) and SHOAL_SHM is not "0"."""
    return os.environ.get("SHOAL_SHM", "1") != "0" and hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


class Outbound:
    """Our region towards one peer: slots we fill, and which of them the peer has handed back."""

    def __init__(self) -> None:
        token = secrets.token_bytes(16)
        self._closing = threading.Lock()
        self._fd: int | None = os.memfd_create("shoal-lane", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, _SIZE)
        self._map = mmap.mmap(self._fd, _SIZE)
        self._view = memoryview(self._map)
        self._view[_TOKEN] = token
        self.name = f"{os.getpid()}:{self._fd}:{token.hex()}"
        self._flags = self._view[:SLOTS]
        self.ready = False  # set once the peer has mapped the region

    def accepted(self) -> None:
        self.ready = True
        self.close_descriptor()

    def close_descriptor(self) -> None:
        """The mapping stays; the descriptor was only there for the peer to open."""
        with self._closing:  # the reader thread (accepted) and close() may both get here
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def put(self, payload: memoryview) -> int | None:
        """Copy `payload` into a free slot and return its index, or None (then use TCP).

        Called only under the peer's write lock, so slots are taken in order without a lock of our own.
        """
        if not self.ready or len(payload) > SLOT_BYTES:
            return None
        for slot in range(SLOTS):  # the lowest free slot: a few slots in turn stay in the caches
            if self._flags[slot] == 0:
                break
        else:
            return None
        self._flags[slot] = 1
        start = _FLAGS + slot * SLOT_BYTES
        _copy(self._view[start:start + len(payload)], payload)
        return slot


class Inbound:
    """The peer's region towards us, which we only read."""

    def __init__(self, name: str) -> None:
        pid, fd_number, token = name.split(":")
        if not (pid.isdigit() and fd_number.isdigit() and len(token) == 32):
            raise ValueError(f"bad shared-memory region name {name!r}")
        # Mapped writable only because torch cannot wrap a read-only buffer; we only write flag bytes.
        fd = os.open(f"/proc/{int(pid)}/fd/{int(fd_number)}", os.O_RDWR)
        try:
            if os.fstat(fd).st_size != _SIZE:
                raise ValueError(f"shared-memory region {name} has the wrong size")
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._view = memoryview(self._map)
        if bytes(self._view[_TOKEN]) != bytes.fromhex(token):
            raise ValueError(f"{name} is not the region the peer announced (another host?)")
        self._flags = self._view[:SLOTS]
        self._lock = threading.Lock()
        self._lent = 0

    def take(self, slot: int, dst: memoryview) -> None:
        start = self._start(slot, len(dst))
        _copy(dst, self._view[start:start + len(dst)])
        self._flags[slot] = 0  # hand the slot back

    def lend(self, slot: int, nbytes: int) -> torch.Tensor | None:
        """The frame in `slot` as a uint8 tensor over the slot itself, without a copy; the slot goes back
        to the sender when the tensor (and every view of it) is freed. None when LENDABLE_SLOTS are out
        already: then `take` a copy, so that tensors kept for long leave slots to the others."""
        start = self._start(slot, nbytes)
        with self._lock:
            if self._lent >= LENDABLE_SLOTS:
                return None
            self._lent += 1
        array = numpy.frombuffer(self._map, dtype=numpy.uint8, count=nbytes, offset=start)
        weakref.finalize(array, self._give_back, slot)  # the tensor holds the array until it is freed
        return torch.from_numpy(array)

    def _give_back(self, slot: int) -> None:
        self._flags[slot] = 0
        with self._lock:
            self._lent -= 1

    @staticmethod
    def _start(slot: int, nbytes: int) -> int:
        if not 0 <= slot < SLOTS or nbytes > SLOT_BYTES:
            raise ConnectionError(f"frame names slot {slot} with {nbytes} bytes; the region has {SLOTS} "
                                  f"slots of {SLOT_BYTES} bytes")
        return _FLAGS + slot * SLOT_BYTES
