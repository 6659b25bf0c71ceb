"""The "shoal" backend: a ProcessGroup over our own transport and ring algorithms.

Operations of a group are numbered in issue order and run one after another on the group's
queue; every frame carries (group, sequence number, signature), so ranks that call different
collectives, or pass tensors of different sizes or dtypes, are told so instead of hanging.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch

from shoal import config
from shoal.comm.algorithms import placement, ring, routing
from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.algorithms.segments import Segments
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.backends.point_to_point import PointToPoint
from shoal.comm.backends.signatures import OPS, describe
from shoal.comm.backends.work import OpQueue, Work
from shoal.comm.store import Store
from shoal.comm.transport import bring_up, dtypes, striping
from shoal.comm.transport.frames import Op, Recv, SendTracker
from shoal.comm.transport.mesh import Transport
from shoal.comm.transport.staging import staged_flat
from shoal.errors import CollectiveMismatchError, GroupBrokenError
from shoal.forks import refuse_in_child
from shoal.observe.flight import recorder


def _at_least(buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
    return buffer if buffer.numel() >= nbytes else torch.empty(nbytes, dtype=torch.uint8)


class _OpChannel:
    """The `ring.Channel` of one operation: group ranks in, global ranks and frame keys out; a large frame
    striped over the pair's connections where it has several."""

    def __init__(self, group: ShoalProcessGroup, op: Op) -> None:
        self.rank, self.size = group.rank, group.size
        self._group, self.op = group, op
        self._transport = group.transport
        self._streams = group.transport.streams
        self._tracker = SendTracker()

    def recv(self, src: int, sub: int, view: memoryview, process: Callable[[], None] | None = None) -> Recv:
        peer = self._group.ranks[src]
        cuts = striping.cuts(len(view), self._streams) if self._streams > 1 else None
        if cuts is None or len(cuts) == 2:
            return self._transport.post_recv(self.op, peer, sub, view, process=process)
        whole = Recv(self.op, peer, sub, view, process, None)
        part_done = striping.gather(whole, len(cuts) - 1)
        for part, (start, stop) in enumerate(itertools.pairwise(cuts)):
            self._transport.post_recv(self.op, peer, striping.part_sub(sub, part, len(cuts) - 1), view[start:stop],
                                      on_done=part_done)
        return whole

    def wait(self, handle: Recv) -> None:
        self._transport.wait(handle)

    def send(self, dst: int, sub: int, view: memoryview) -> None:
        peer = self._group.ranks[dst]
        if self._streams == 1:
            self._transport.send(self.op, peer, sub, view, self._tracker)
            return
        cuts = striping.cuts(len(view), self._streams)
        for part, (start, stop) in enumerate(itertools.pairwise(cuts)):
            self._transport.send(self.op, peer, striping.part_sub(sub, part, len(cuts) - 1), view[start:stop],
                                 self._tracker)

    def flush(self) -> None:
        self._tracker.wait(self.op.deadline, self.op.name)

    def check(self) -> None:
        self._transport.check(self.op)

    def abort(self, error: BaseException) -> None:
        self._transport.abort(self.op, error)

    def scratch(self, nbytes: int) -> torch.Tensor:
        return self._group.scratch(nbytes)

    def packing(self, nbytes: int) -> torch.Tensor:
        return self._group.packing(nbytes)


class ShoalProcessGroup(PointToPoint, ProcessGroup):
    backend = "shoal"
    coalesces_for_free = True

    def __init__(self, transport: Transport, ranks: Sequence[int], group_id: int, timeout: timedelta,
                 group_ids: Callable[[], int], *, owns_transport: bool = False) -> None:
        super().__init__(ranks, transport.rank, timeout)
        self.transport = transport
        self._group_id = group_id
        self._next_group_id = group_ids
        self._seq = itertools.count()
        self._sent = defaultdict(itertools.count)  # (dst, tag) -> next p2p sequence number
        self._received: defaultdict[tuple[int, int], int] = defaultdict(int)  # (src, tag) -> next p2p sequence number
        # tag -> receives issued after a receive from any source on that tag that has not yet matched:
        # numbered once it has, as until then no one knows whose next message it took
        self._behind_any: dict[int, list[tuple[Work, torch.Tensor, Callable[[], None], int | None]]] = {}
        self._queue = OpQueue(f"shoal-group-{group_id}")
        self._issue = threading.Lock()  # sequence numbers and queue order must agree
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._packing = torch.empty(0, dtype=torch.uint8)
        self._broken: BaseException | None = None
        self._owns_transport = owns_transport
        self._placement: placement.Placement | None = None

    @classmethod
    def create(cls, store: Store, rank: int, world_size: int, timeout: timedelta,
               master_host: str) -> ShoalProcessGroup:
        """The world group: connected to every other rank (transport/bring_up.py)."""
        transport, entries = bring_up.listen(store, rank, world_size, toward=master_host, timeout=timeout,
                                             stall_timeout=timeout, streams=config.SHOAL_STREAMS.get())
        try:
            bring_up.connect(transport, entries, timeout)
        except BaseException:
            transport.close()
            raise
        group_ids = itertools.count(1)
        return cls(transport, range(world_size), 0, timeout, lambda: next(group_ids), owns_transport=True)

    def failed_ranks(self) -> frozenset[int]:
        return frozenset(r for r, member in enumerate(self.ranks) if self.transport.failure(member) is not None)

    def scratch(self, nbytes: int) -> torch.Tensor:
        """Reusable staging memory; ops run one at a time, so one buffer serves them all."""
        self._scratch = _at_least(self._scratch, nbytes)
        return self._scratch[:nbytes]

    def packing(self, nbytes: int) -> torch.Tensor:
        """Reusable memory to pack several tensors into one for an op (beside `scratch`, which the op
        may use too)."""
        self._packing = _at_least(self._packing, nbytes)
        return self._packing[:nbytes]

    @property
    def hosts(self) -> tuple[tuple[int, ...], ...] | None:
        """The group's global ranks by host (ranks that share memory), once a collective has found them."""
        if self._placement is None:
            return None
        return tuple(tuple(self.ranks[r] for r in host) for host in self._placement.hosts)

    def _place(self, ch: _OpChannel) -> placement.Placement:
        """Where the group's ranks are, found in the first collective that needs to know."""
        if self._placement is None:
            self._placement = placement.alone() if self.size == 1 else placement.discover(ch, self.ranks)
        return self._placement

    def _routed(self, route: Callable[..., None], *args: object) -> Callable[[_OpChannel], None]:
        """The body of a collective whose path `route` (in routing.py) picks from the group's placement."""
        return lambda ch: route(ch, self._place(ch), *args)

    def _over_ring(self, algorithm: Callable[..., None], *args: object) -> Callable[[_OpChannel], None]:
        """The body of a collective that always runs on the ring."""
        return lambda ch: routing.on_ring(ch, self._place(ch), lambda: algorithm(ch, *args))

    # ---- collectives -------------------------------------------------------------------------

    def _collective(self, name: str, tensor: torch.Tensor | None, body: Callable[[_OpChannel], None], *,
                    redop: int = 0, root: int = 0, numel: int | None = None,
                    finish: Callable[[], None] = lambda: None, blocking: bool = False,
                    timeout: timedelta | None = None) -> Work:
        self._refuse_if_forked()
        dtype = dtypes.code(tensor.dtype, f"{name} on the shoal backend") if tensor is not None else 0
        count = numel if numel is not None else (tensor.numel() if tensor is not None else 0)
        sig = (OPS.index(name), dtype, int(redop), root, count)
        timeout = timeout or self.timeout
        work = Work(name, timeout)
        nbytes = count * tensor.element_size() if tensor is not None else 0

        def run() -> None:
            op = Op(self._group_id, -1, seq, sig, self.ranks, timeout, name, describe, deadline=work.deadline)
            traced = {"bytes": nbytes, "group": self._group_id, "seq": seq}
            on_timeline = work.running(traced) is not None
            if self._broken is not None:
                work.finish(GroupBrokenError(f"{name}: this group failed earlier ({self._broken}); "
                                             f"destroy it and create a new one"))
                return
            try:
                self.transport.begin(op)
                channel = _OpChannel(self, op)
                body(channel)
                channel.flush()
                finish()
                if on_timeline:
                    traced["algorithm"] = routing.path(name, self._placement, nbytes)
                work.finish()
            except CollectiveMismatchError as exc:
                # Every rank aborted this op alike, so the group stays usable; frames of the failed op
                # may still be landing in the scratch or packing buffer, so the next op gets fresh ones.
                self._scratch = torch.empty(0, dtype=torch.uint8)
                self._packing = torch.empty(0, dtype=torch.uint8)
                work.finish(exc)
            except Exception as exc:
                self._broken = exc
                work.finish(exc)
            finally:
                self.transport.end(op)

        with self._issue:
            seq = next(self._seq)
            work.flight = recorder.record(self._group_id, self.ranks, seq, name, functools.partial(describe, sig),
                                          nbytes)
            here = self._queue.submit(run, inline_if_idle=blocking)
        if here:
            self._queue.run_here(run)
        return work

    def _start_all_reduce(self, tensor: torch.Tensor, op: ReduceOp, blocking: bool) -> Work:
        return self._start_all_reduce_coalesced([tensor], op, blocking)

    def _start_all_reduce_coalesced(self, tensors: list[torch.Tensor], op: ReduceOp, blocking: bool) -> Work:
        copies = [staged_flat(t) for t in tensors]
        given = Segments([flat for flat, _ in copies])
        # Tensors that share memory are reduced as one packed copy: reduced where they lie, a later round
        # would read what an earlier one wrote.
        data = given if given.disjoint() else Segments([torch.cat(given.tensors)])

        def finish() -> None:
            given.unpack(data.tensors[0])
            for _, back in copies:
                back()

        # The same collective as an all_reduce of the concatenation, which another rank may pass instead.
        return self._collective("all_reduce", data.tensors[0], self._routed(routing.all_reduce, data, op), redop=op,
                                numel=data.numel, finish=finish, blocking=blocking)

    def _start_broadcast(self, tensor: torch.Tensor, src: int, blocking: bool) -> Work:
        flat, back = staged_flat(tensor)
        return self._collective("broadcast", flat, self._routed(routing.broadcast, flat, src), root=src,
                                finish=back, blocking=blocking)

    def _start_reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, blocking: bool) -> Work:
        flat, back = staged_flat(tensor)
        return self._collective("reduce", flat, self._over_ring(ring.reduce, flat, op, dst), redop=op,
                                root=dst, finish=back if self.rank == dst else lambda: None, blocking=blocking)

    def _start_all_gather(self, outs: list[torch.Tensor], tensor: torch.Tensor, blocking: bool) -> Work:
        mine, _ = staged_flat(tensor)
        staged = [staged_flat(t) for t in outs]
        flats = [f for f, _ in staged]
        return self._collective("all_gather", mine, self._routed(routing.all_gather, flats, mine),
                                finish=_all(back for _, back in staged), blocking=blocking)

    def _start_gather(self, tensor: torch.Tensor, outs: list[torch.Tensor] | None, dst: int, blocking: bool) -> Work:
        mine, _ = staged_flat(tensor)
        staged = [staged_flat(t) for t in outs] if outs is not None else []
        flats = [f for f, _ in staged] if outs is not None else None
        return self._collective("gather", mine, self._over_ring(ring.gather, flats, mine, dst), root=dst,
                                finish=_all(back for _, back in staged), blocking=blocking)

    def _start_scatter(self, tensor: torch.Tensor, ins: list[torch.Tensor] | None, src: int, blocking: bool) -> Work:
        out, back = staged_flat(tensor)
        blocks = [staged_flat(t)[0] for t in ins] if ins is not None else None
        return self._collective("scatter", out, self._over_ring(ring.scatter, out, blocks, src), root=src,
                                finish=back, blocking=blocking)

    def _start_reduce_scatter(self, out: torch.Tensor, ins: list[torch.Tensor], op: ReduceOp, blocking: bool) -> Work:
        flat, back = staged_flat(out)
        blocks = [staged_flat(t)[0] for t in ins]
        return self._collective("reduce_scatter", flat, self._routed(routing.reduce_scatter, flat, blocks, op),
                                redop=op, finish=back, blocking=blocking)

    def _start_all_to_all(self, outs: list[torch.Tensor], ins: list[torch.Tensor], blocking: bool) -> Work:
        staged = [staged_flat(t) for t in outs]
        flats = [f for f, _ in staged]
        blocks = [staged_flat(t)[0] for t in ins]
        # Sizes may differ per pair of ranks, so the signature carries none; each frame's length is checked.
        return self._collective("all_to_all", blocks[0], self._over_ring(ring.all_to_all, flats, blocks),
                                numel=0, finish=_all(back for _, back in staged), blocking=blocking)

    def _start_barrier(self, blocking: bool, timeout: timedelta | None = None) -> Work:
        return self._collective("barrier", None, self._routed(routing.barrier), blocking=blocking, timeout=timeout)

    # ---- lifecycle ---------------------------------------------------------------------------

    def new_subgroup(self, ranks: Sequence[int], timeout: timedelta | None = None, *,
                     name: str | None = None) -> ShoalProcessGroup | None:
        # Without a name, the id is drawn on every rank, members or not, to stay in step.
        group_id = self._next_group_id() if name is None else named_group_id(name)
        if self.transport.rank not in ranks:
            return None
        return self.subgroup(ranks, group_id, timeout or self.timeout)

    def subgroup(self, ranks: Sequence[int], group_id: int, timeout: timedelta) -> ShoalProcessGroup:
        """A group of the given global ranks (ours among them) over this group's transport, whose frames
        carry `group_id`: every member must pass the same one, and no other group of theirs may use it."""
        self._refuse_if_forked()
        return ShoalProcessGroup(self.transport, ranks, group_id, timeout, self._next_group_id)

    def _refuse_if_forked(self) -> None:
        refuse_in_child(self.made_in, "this process group", "call init_process_group in this process")

    def shutdown(self) -> None:
        if os.getpid() != self.made_in:
            return  # the parent's connections, which it goes on using: a forked child leaves them alone
        self._queue.close(self.timeout)
        self._placement = None  # our arena's memory goes once the peers have let go of it too
        if self._owns_transport:
            self.transport.close(self.timeout)


def named_group_id(name: str) -> int:
    """The id the frames of the group `name` carry: drawn from the name, which the members give alike.
    Frames carry 32 bits: ids from 2**30 to 2**31 are kept apart from the small ones shoal's unnamed
    subgroups count up from 1, and from RPC's (2**32 - 256)."""
    digest = hashlib.blake2b(name.encode(), digest_size=4).digest()
    return (1 << 30) | (int.from_bytes(digest, "big") & ((1 << 30) - 1))


def _all(callbacks) -> Callable[[], None]:
    callbacks = list(callbacks)
    return lambda: [cb() for cb in callbacks]
