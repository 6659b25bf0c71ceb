"""The shared memory of the ranks of one group that share a host, and the rounds in which they use it.

Each member has a region (region.py) that it alone writes and every member maps. A round: wait until
every member has settled the previous round, write our inputs, post (publish the round number, then
wait for everyone's), read the others' inputs, write our results, settle (publish that we are done);
those who need everyone's results wait until all have settled and read them. Posting and settling are
32-bit counters in the region's header that only its owner writes; a member waiting for another sleeps
on the counter (futex.py), so waiting costs no CPU. Where every member of the arena has a core of its own,
a waiting member first polls the counter for up to 30 microseconds: a peer a moment behind is then seen
without the kernel's wake-up, which costs tens of microseconds a round (more on a virtual machine, whose
sleeping CPU must be woken). Where members share cores, polling would take the core the awaited member
needs, so they sleep at once. Only the arena's members are counted, against this process's CPU affinity:
other groups' ranks and other processes on the host are not seen.

Inputs and results live apart in a region, because they are safe to overwrite at different times:
inputs once everyone has settled the previous round (they read inputs before settling), results
once everyone has posted this one (they read results before posting again).

Before the first round of each operation a member writes which operation it is in (sequence number
and signature); whoever sees a different one at the first post raises CollectiveMismatchError, and
since every member sees the same signatures, all of them do, in the same round: the arena stays in
step. Operations that run outside the arena (over the transport) announce themselves the same way,
so that a member waiting in the arena for a peer that called something else finds out, and aborts
the operation on the transport for the peers waiting there. Any other failure inside an operation
leaves the members out of step, so the failing member marks its region abandoned and the others,
instead of waiting for it in vain, raise GroupBrokenError.
"""

from __future__ import annotations

import ctypes
import os
import struct
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from shoal.comm.shm import futex
from shoal.comm.shm.region import HEADER_BYTES, Region
from shoal.comm.transport.frames import Op
from shoal.errors import CollectiveMismatchError, GroupBrokenError

# Header words, each on a cache line of its own (the region's token comes first).
_POSTED = HEADER_BYTES  # uint32: the last round whose data this member has written
_SETTLED = 2 * HEADER_BYTES  # uint32: the last round in which this member has read everyone's data
_ABANDONED = 3 * HEADER_BYTES  # uint32: nonzero once this member has left the arena out of step
_SEQ = 4 * HEADER_BYTES  # int64: the sequence number of the operation this member is in (-1: changing)
_SIGNATURE = _SEQ + 8  # whether that operation runs outside the arena, and its signature
_SIGNATURE_LAYOUT = struct.Struct("<6q")
INPUTS = 4096  # where a region's inputs start
INPUT_BYTES = 4 << 20  # a round moves at most this much per member
RESULT_BYTES = INPUT_BYTES // 2  # a member's results in a round: at most half a round's inputs
SIZE = INPUTS + INPUT_BYTES + RESULT_BYTES
_SLICE_S = 0.05  # a waiting member looks for failures this often
_POLL_S = 30e-6  # how long a waiting member polls before it sleeps, where every member has a core


class Watch(Protocol):
    """How a member waiting in the arena learns of failures outside it, and reports its own."""

    def check(self) -> None:
        """Raise if the operation can no longer complete (a member failed, it was aborted elsewhere)."""

    def abort(self, error: BaseException) -> None:
        """Fail the operation for the members waiting on the transport."""


class _InStepMismatch(CollectiveMismatchError):
    """A mismatch every member sees in the same round: the arena stays in step."""


def new_region() -> Region:
    """Our region, before anyone maps it: in no operation yet."""
    region = Region.create(SIZE, "shoal-arena")
    struct.pack_into("<q", region.memory, _SEQ, -1)
    return region


def poll_seconds(members: int) -> float:
    """How long a member of an arena of `members` polls a counter before sleeping on it: `_POLL_S` where
    this process may run on at least as many cores as there are members, else not at all."""
    return _POLL_S if members <= len(os.sched_getaffinity(0)) else 0.0


def _reached(value: int, target: int) -> bool:
    """value >= target for round counters that wrap around at 2**32."""
    return (value - target) & 0xFFFFFFFF < 0x80000000


class _Member:
    """One member's region as everyone sees it: its header words and its data."""

    def __init__(self, region: Region) -> None:
        self.region = region
        self.posted = ctypes.c_uint32.from_buffer(region.memory, _POSTED)
        self.settled = ctypes.c_uint32.from_buffer(region.memory, _SETTLED)
        self.abandoned = ctypes.c_uint32.from_buffer(region.memory, _ABANDONED)
        self.seq = ctypes.c_int64.from_buffer(region.memory, _SEQ)
        self.inputs = torch.frombuffer(region.view[INPUTS:INPUTS + INPUT_BYTES], dtype=torch.uint8)
        self.results = torch.frombuffer(region.view[INPUTS + INPUT_BYTES:SIZE], dtype=torch.uint8)

    def operation(self) -> tuple[int, bool, tuple[int, ...]] | None:
        """(sequence number, outside the arena?, signature) of the member's operation, or None while its
        owner is changing it."""
        seq = self.seq.value
        outside, *signature = _SIGNATURE_LAYOUT.unpack_from(self.region.memory, _SIGNATURE)
        if seq == -1 or self.seq.value != seq:
            return None
        return seq, bool(outside), tuple(signature)

    def write_operation(self, seq: int, outside: bool, signature: tuple[int, ...]) -> None:
        """A seqlock: readers that see the same number before and after reading the signature saw the
        signature written under it (x86-64 keeps stores, and loads, in order)."""
        self.seq.value = -1
        _SIGNATURE_LAYOUT.pack_into(self.region.memory, _SIGNATURE, int(outside), *signature)
        self.seq.value = seq


class Arena:
    """The regions of the members of one group on one host (global `ranks`, ours at `me`)."""

    def __init__(self, regions: Sequence[Region], ranks: Sequence[int], me: int) -> None:
        self.ranks = tuple(ranks)
        self.me = me
        self.size = len(regions)
        self._members = [_Member(region) for region in regions]
        self._own = self._members[me]
        self._round = self._own.posted.value
        self._op: Op | None = None
        self._watch: Watch | None = None
        self._first = False
        self._poll_s = poll_seconds(self.size)

    def inputs(self, member: int) -> torch.Tensor:
        """The inputs of `member`'s region, as bytes: write only our own, and only before posting."""
        return self._members[member].inputs

    def results(self, member: int) -> torch.Tensor:
        """The results of `member`'s region, as bytes: write only our own, and only after posting."""
        return self._members[member].results

    def run(self, op: Op, watch: Watch, body: Callable[[], None]) -> None:
        """Run one operation's rounds (`body`)."""
        self._enter(op, watch, outside=False)
        try:
            body()
        except _InStepMismatch:
            raise
        except BaseException:
            self.abandon()
            raise
        finally:
            self._op = None

    def announce(self, op: Op, watch: Watch) -> None:
        """Say that we are in `op`, which runs outside the arena."""
        try:
            self._enter(op, watch, outside=True)
        finally:
            self._op = None

    def _enter(self, op: Op, watch: Watch, *, outside: bool) -> None:
        if self._own.abandoned.value:
            raise GroupBrokenError(f"{op.name}: this group's shared memory was left out of step by an earlier "
                                   f"failure; destroy the group and create a new one")
        self._op, self._watch, self._first = op, watch, True
        self._wait_all("settled", self._round)  # everyone has read our last signature
        self._own.write_operation(op.seq, outside, op.sig)

    def begin_round(self) -> None:
        """Wait until every member has read the previous round's inputs: ours may then be overwritten."""
        self._wait_all("settled", self._round)

    def post(self) -> None:
        """Publish that our inputs for this round are written; return once everyone's are."""
        self._round = (self._round + 1) & 0xFFFFFFFF
        self._publish(self._own.posted)
        self._wait_all("posted", self._round)
        if self._first:
            self._first = False
            self._compare_operations()

    def settle(self) -> None:
        """Publish that we have read the inputs we needed and written our results of this round."""
        self._publish(self._own.settled)

    def wait_settled(self) -> None:
        """Return once every member has settled this round: everyone's results are written."""
        self._wait_all("settled", self._round)

    def abandon(self) -> None:
        """Tell the other members not to wait for us: we are out of step."""
        self._own.abandoned.value = 1
        for word in (self._own.posted, self._own.settled):
            futex.wake(ctypes.addressof(word))

    def _publish(self, word: ctypes.c_uint32) -> None:
        word.value = self._round  # after our data: x86-64 keeps stores in order (futex.py)
        futex.wake(ctypes.addressof(word))

    def _wait_all(self, counter: str, target: int) -> None:
        for index, member in enumerate(self._members):
            if index == self.me:
                continue
            word = getattr(member, counter)
            value = word.value
            self._refuse_abandoned(index)  # its counters say nothing any more
            if not _reached(value, target) and self._poll_s:
                value = self._polled(word, target)
            while not _reached(value, target):
                self._stalled(index)
                futex.wait(ctypes.addressof(word), value, min(_SLICE_S, self._op.deadline - time.monotonic()))
                value = word.value

    def _polled(self, word: ctypes.c_uint32, target: int) -> int:
        """The word's value once it reaches `target`, or after `_poll_s` of polling."""
        until = time.perf_counter() + self._poll_s
        value = word.value
        while not _reached(value, target) and time.perf_counter() < until:
            value = word.value
        return value

    def _refuse_abandoned(self, index: int) -> None:
        member = self._members[index]
        if member.abandoned.value:
            self.abandon()  # and so those waiting for us stop as soon
            theirs = member.operation()
            if theirs is not None and theirs[0] == self._op.seq and theirs[2] != self._op.sig:
                # It gave up on this very operation, having called another collective: that is the error,
                # whether we see its mark here or hear of it over the transport first.
                raise self._mismatch(index, theirs)
            raise GroupBrokenError(f"{self._op.name}: rank {self.ranks[index]} failed in this group earlier and "
                                   f"left its shared memory out of step; destroy the group and create a new one")

    def _stalled(self, index: int) -> None:
        op = self._op
        self._refuse_abandoned(index)
        self._watch.check()
        # A member in this same operation outside the arena will not come: it called another collective.
        # Every member is looked at, not only the one awaited, which may have gone on to later ones.
        for other, member in enumerate(self._members):
            theirs = member.operation()
            if theirs is not None and theirs[0] == op.seq and theirs[1] and theirs[2] != op.sig:
                error = self._mismatch(other, theirs)
                self.abandon()  # before the peers hear of it, lest they find our counters as they are
                self._watch.abort(error)
                raise error
        if time.monotonic() >= op.deadline:
            raise TimeoutError(f"{op.name} on rank {self.ranks[self.me]}: nothing from rank {self.ranks[index]} "
                               f"within {op.timeout.total_seconds():g}s (is it alive but not calling {op.name}?)")

    def _compare_operations(self) -> None:
        op = self._op
        for index, member in enumerate(self._members):
            theirs = member.operation()
            assert theirs is not None, "a member changed its signature after posting"
            if theirs != (op.seq, False, op.sig):
                self.settle()  # as every member does: the arena stays in step for the next operation
                error = self._mismatch(index, theirs, in_step=True)
                self._watch.abort(error)  # for ranks of other hosts, waiting on the transport (mixed groups)
                raise error

    def _mismatch(self, index: int, theirs: tuple[int, bool, tuple[int, ...]], *,
                  in_step: bool = False) -> CollectiveMismatchError:
        op = self._op
        if theirs[0] != op.seq:
            what = f"is at operation #{theirs[0]} of this group, this rank at #{op.seq}"
        else:
            what = f"called {op.describe(theirs[2])}"
        kind = _InStepMismatch if in_step else CollectiveMismatchError
        return kind(f"{op.name}: rank {self.ranks[self.me]} called {op.describe(op.sig)} but rank "
                    f"{self.ranks[index]} {what}; every rank must pass matching tensors")
