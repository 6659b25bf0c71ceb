"""Shared-memory lanes between ranks on one host: large frames skip the kernel's socket copies.

The sender copies a frame's payload into a free slot of its outbound region and sends only the
header over the (authenticated) TCP connection; the receiver copies the slot into the posted
buffer and marks the slot free again in the region's flag bytes (the sender alone marks slots
busy, the receiver alone marks them free). A sender that finds no free slot sends over TCP
instead, so nothing ever waits for the peer. Regions are files in /dev/shm, mode 0600, named at
random and announced over the authenticated connection; the creator unlinks the file once the
peer has mapped it.
"""

from __future__ import annotations

import mmap
import os
import secrets

import torch

SLOT_BYTES = 2 << 20  # one ring chunk (ring.CHUNK_BYTES) per slot
SLOTS = 16
_FLAGS = 4096  # one byte per slot (1: holds a frame not yet taken), padded to a page
_SIZE = _FLAGS + SLOTS * SLOT_BYTES
_DIR = "/dev/shm"


def _copy(dst: memoryview, src: memoryview) -> None:
    # torch's copy releases the GIL, so reader and sender threads copy in parallel.
    torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))


def available() -> bool:
    """Whether to offer lanes: /dev/shm is usable and SHOAL_SHM is not "0" (forces plain TCP)."""
    return os.environ.get("SHOAL_SHM", "1") != "0" and os.path.isdir(_DIR) and os.access(_DIR, os.W_OK)


class Outbound:
    """Our region towards one peer: slots we fill, and which of them the peer has handed back."""

    def __init__(self) -> None:
        self.name = f"shoal-{secrets.token_hex(16)}"
        self._path = os.path.join(_DIR, self.name)
        fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._view = memoryview(self._map)
        self._flags = self._view[:SLOTS]
        self._next = 0
        self.ready = False  # set once the peer has mapped the region

    def accepted(self) -> None:
        self.ready = True
        self.unlink()

    def unlink(self) -> None:
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass

    def put(self, payload: memoryview) -> int | None:
        """Copy `payload` into a free slot and return its index, or None (then use TCP).

        Called only from the peer's send thread, so slots are taken in order without a lock.
        """
        if not self.ready or len(payload) > SLOT_BYTES:
            return None
        for slot in (*range(self._next, SLOTS), *range(self._next)):
            if self._flags[slot] == 0:
                break
        else:
            return None
        self._flags[slot] = 1
        self._next = (slot + 1) % SLOTS
        start = _FLAGS + slot * SLOT_BYTES
        _copy(self._view[start:start + len(payload)], payload)
        return slot


class Inbound:
    """The peer's region towards us, which we only read."""

    def __init__(self, name: str) -> None:
        if not name.startswith("shoal-") or "/" in name:
            raise ValueError(f"bad shared-memory region name {name!r}")
        # Mapped writable only because torch cannot wrap a read-only buffer; we never write to it.
        fd = os.open(os.path.join(_DIR, name), os.O_RDWR)
        try:
            if os.fstat(fd).st_size != _SIZE:
                raise ValueError(f"shared-memory region {name} has the wrong size")
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._view = memoryview(self._map)
        self._flags = self._view[:SLOTS]

    def take(self, slot: int, dst: memoryview) -> None:
        if not 0 <= slot < SLOTS or len(dst) > SLOT_BYTES:
            raise ConnectionError(f"frame names slot {slot} with {len(dst)} bytes; the region has {SLOTS} "
                                  f"slots of {SLOT_BYTES} bytes")
        start = _FLAGS + slot * SLOT_BYTES
        _copy(dst, self._view[start:start + len(dst)])
        self._flags[slot] = 0  # hand the slot back
