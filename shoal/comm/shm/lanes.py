"""Shared-memory lanes between ranks on one host: large frames skip the kernel's socket copies.

The sender copies a frame's payload into a free slot of its outbound region and sends only the
header over the (authenticated) TCP connection; the receiver copies the slot into the posted
buffer and marks the slot free again in the region's flag bytes (the sender alone marks slots
busy, the receiver alone marks them free). A sender that finds no free slot sends over TCP
instead, so nothing ever waits for the peer. The slots live in a `region.Region`, announced over
the connection the lane belongs to.
"""

from __future__ import annotations

import threading
import weakref

import numpy
import torch

from shoal.comm.shm.region import HEADER_BYTES, Region, available

__all__ = ["LENDABLE_SLOTS", "SLOTS", "SLOT_BYTES", "Inbound", "Outbound", "available"]

SLOT_BYTES = 2 << 20  # one ring chunk (ring.CHUNK_BYTES) per slot
SLOTS = 16
LENDABLE_SLOTS = SLOTS // 2  # slots a receiver may keep as tensors at once (`Inbound.lend`)
_FLAGS = slice(HEADER_BYTES, HEADER_BYTES + SLOTS)  # one byte per slot (1: holds a frame not yet taken)
_DATA = 4096  # slots start a page in
_SIZE = _DATA + SLOTS * SLOT_BYTES


def _copy(dst: memoryview, src: memoryview) -> None:
    # numpy's copy releases the GIL, so reader and sender threads copy in parallel, and it takes
    # read-only memory (a pickled RPC body is bytes) without the warning torch.frombuffer prints.
    numpy.copyto(numpy.frombuffer(dst, dtype=numpy.uint8), numpy.frombuffer(src, dtype=numpy.uint8))


class Outbound:
    """Our region towards one peer: slots we fill, and which of them the peer has handed back."""

    def __init__(self) -> None:
        self._region = Region.create(_SIZE, "shoal-lane")
        self._view = self._region.view
        self.name = self._region.name
        self._flags = self._view[_FLAGS]
        self.ready = False  # set once the peer has mapped the region

    def accepted(self) -> None:
        self.ready = True
        self.close_descriptor()

    def close_descriptor(self) -> None:
        self._region.close_descriptor()

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
        start = _DATA + slot * SLOT_BYTES
        _copy(self._view[start:start + len(payload)], payload)
        return slot


class Inbound:
    """The peer's region towards us, which we only read."""

    def __init__(self, name: str) -> None:
        region = Region.open(name, _SIZE)
        self._map = region.memory
        self._view = region.view
        self._flags = self._view[_FLAGS]
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
        return _DATA + slot * SLOT_BYTES
