"""ProcessGroup that delegates to torch.distributed's engines (backend "gloo" on CPUs, "nccl" on GPUs), so
every shoal feature also runs on PyTorch's own engine by changing one argument.

Each group builds its engine object itself, over its own prefix of the job's store, and calls it
directly: torch.distributed's global state (its default group, its registry of groups) is never
touched. A script may then initialize torch.distributed itself beside shoal, and shoal can build as
many groups, and rebuild them, as it needs."""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as tdist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from shoal.comm.algorithms.reduce_op import ReduceOp, finish_
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.backends.work import Work
from shoal.comm.store import Store
from shoal.comm.transport.staging import staged
from shoal.errors import PeerFailure
from shoal.observe.flight import recorder

_TORCH_OPS = {
    ReduceOp.SUM: tdist.ReduceOp.SUM,
    ReduceOp.AVG: tdist.ReduceOp.SUM,  # averaged after the sum: gloo has no AVG
    ReduceOp.PRODUCT: tdist.ReduceOp.PRODUCT,
    ReduceOp.MIN: tdist.ReduceOp.MIN,
    ReduceOp.MAX: tdist.ReduceOp.MAX,
    ReduceOp.BAND: tdist.ReduceOp.BAND,
    ReduceOp.BOR: tdist.ReduceOp.BOR,
    ReduceOp.BXOR: tdist.ReduceOp.BXOR,
}
_PEER_LOST_HINTS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
# A Gloo worker thread drops its reference to an operation just after completing it. If that is the last
# reference, it frees the operation's tensors there, which takes the GIL; once the interpreter is
# finalizing, taking the GIL ends the thread inside C++ and aborts the process ("terminate called without
# an active exception"). A group that the script never destroys keeps its threads to the very end. Each
# Gloo group therefore holds its last operations (more than its two workers can be finishing at once),
# and at shutdown hands them to this list, which only the interpreter's own teardown frees, on its main
# thread: a worker's drop of a recent operation is then not the last. An operation still running at
# exit is not covered.
_RECENT_OPS = 8
_held_until_exit: collections.deque = collections.deque(maxlen=4 * _RECENT_OPS)


class _TorchWork(Work):
    """A torch Work, plus what must happen once it is done (copy back from staging, AVG's division),
    run exactly once, by whoever first sees the torch Work complete."""

    def __init__(self, name: str, timeout: timedelta, work, then: Callable[[], None]) -> None:
        super().__init__(name, timeout)
        self._work = work
        self._then = then
        self._settling = threading.Lock()

    def wait(self, timeout: timedelta | None = None) -> bool:
        with self._settling:
            if not super().is_completed():
                try:
                    self._work.wait(timeout) if timeout is not None else self._work.wait()
                except RuntimeError as exc:
                    if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                        recorder.dump(f"{self.name} timed out: {exc}")
                        raise TimeoutError(f"{self.name}: {exc}") from None  # not final: may wait again
                    lost = any(hint in str(exc) for hint in _PEER_LOST_HINTS)
                    self.finish(PeerFailure(None, f"{self.name}: {exc}") if lost else exc)
                else:
                    self._then()
                    self.finish()
        return super().wait(timedelta(0))

    def is_completed(self) -> bool:
        if not super().is_completed() and self._work.is_completed():
            try:
                self.wait()
            except Exception:  # kept in the Work: exception() and wait() report it
                pass
        return super().is_completed()


def _engine(backend: str, store: tdist.Store, name: str, ranks: Sequence[int], rank: int, timeout: timedelta):
    """torch's engine for the group `name` of global `ranks` (ours at `rank`), meeting its peers under
    `name` in `store`, with the options torch.distributed would give it."""
    store = tdist.PrefixStore(name, store)
    if backend == "gloo":
        engine = tdist.ProcessGroupGloo(store, rank, len(ranks), timeout)
        options = engine.options
    else:
        options = tdist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
    options.global_ranks_in_group = list(ranks)
    options.group_name = name
    return engine if backend == "gloo" else tdist.ProcessGroupNCCL(store, rank, len(ranks), options)


def _options(kind, **fields):
    options = kind()
    for name, value in fields.items():
        setattr(options, name, value)
    return options


def _reducing(kind, op: ReduceOp, **fields):
    return _options(kind, reduceOp=_TORCH_OPS[op], **fields)


class C10dProcessGroup(ProcessGroup):
    """Ranks given to the engine are member indices, as in shoal's own groups."""

    def __init__(self, backend: str, store: tdist.Store, name: str, ranks: Sequence[int], global_rank: int,
                 timeout: timedelta) -> None:
        super().__init__(ranks, global_rank, timeout)
        self.backend = backend
        self._store, self._name = store, name
        self._engine = _engine(backend, store, name, self.ranks, self.rank, timeout)
        self._subgroups_made = 0
        # Operations issued, for the flight recorder: collectives (key None), and sends or receives per
        # (kind, peer, tag), numbered as the shoal backend numbers them.
        self._issued: dict[tuple | None, itertools.count] = collections.defaultdict(itertools.count)
        # Gloo's TCP pairs and its gather, scatter, all-to-all and reduce-scatter read host memory only
        # (a GPU pointer handed to them kills the process): those stage GPU tensors through the host.
        self._host_only = "cpu" if backend == "gloo" else None
        # See _held_until_exit (seen with Gloo; NCCL's teardown is its own).
        self._recent: collections.deque | None = collections.deque(maxlen=_RECENT_OPS) if backend == "gloo" else None

    @classmethod
    def create(cls, backend: str, store: Store, rank: int, world_size: int,
               timeout: timedelta) -> C10dProcessGroup:
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA GPUs; use backend 'gloo' or 'shoal' on CPUs")
        return cls(backend, store.raw, store.prefix + "c10d/", range(world_size), rank, timeout)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def _wrap(self, name: str, work, then: Callable[[], None] = lambda: None, *, peer: int | None = None,
              tag: int | None = None, timeout: timedelta | None = None) -> Work:
        """Our Work for torch's; its flight entry and span run from now until completion is seen. A send
        or receive (`name` "send" or "recv") names its `peer` (a global rank) and `tag`."""
        if self._recent is not None:
            self._recent.append(work)
        if peer is not None:
            label = f"{name} {'to' if name == 'send' else 'from'} rank {peer}"
        else:
            label = "recv from any rank" if name == "recv" else name
        wrapped = _TorchWork(label, timeout or self.timeout, work, then)
        seq = next(self._issued[None if tag is None else (name, peer, tag)])  # a recv from any source: peer None
        wrapped.flight = recorder.record(self._name, self.ranks, seq, name, label, 0, peer=peer, tag=tag)
        wrapped.running({"group": self._name, "seq": seq, "algorithm": self.backend})
        return wrapped

    def _start_all_reduce(self, tensor: torch.Tensor, op: ReduceOp, blocking: bool) -> Work:
        t, back = staged(tensor)
        work = self._engine.allreduce([t], _reducing(AllreduceOptions, op))
        return self._wrap("all_reduce", work, lambda: (finish_(t, op, self.size), back()))

    def _start_all_reduce_coalesced(self, tensors: list[torch.Tensor], op: ReduceOp, blocking: bool) -> Work:
        flat = torch.cat([t.reshape(-1) for t in tensors])

        def then() -> None:
            finish_(flat, op, self.size)
            for tensor, piece in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                tensor.copy_(piece.view_as(tensor))

        work = self._engine.allreduce([flat], _reducing(AllreduceOptions, op))
        return self._wrap("all_reduce", work, then)

    def _start_broadcast(self, tensor: torch.Tensor, src: int, blocking: bool) -> Work:
        t, back = staged(tensor)
        work = self._engine.broadcast([t], _options(BroadcastOptions, rootRank=src, rootTensor=0))
        return self._wrap("broadcast", work, back)

    def _start_reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, blocking: bool) -> Work:
        # gloo's reduce scribbles over non-root inputs; reduce a copy there so they stay as they were.
        t, back = staged(tensor) if self.rank == dst else (tensor.clone(), lambda: None)
        work = self._engine.reduce([t], _reducing(ReduceOptions, op, rootRank=dst, rootTensor=0))
        done = (lambda: (finish_(t, op, self.size), back())) if self.rank == dst else (lambda: None)
        return self._wrap("reduce", work, done)

    def _start_all_gather(self, outs: list[torch.Tensor], tensor: torch.Tensor, blocking: bool) -> Work:
        outputs = [staged(o) for o in outs]
        work = self._engine.allgather([[s for s, _ in outputs]], [tensor.contiguous()], AllgatherOptions())
        return self._wrap("all_gather", work, lambda: [back() for _, back in outputs])

    def _start_gather(self, tensor: torch.Tensor, outs: list[torch.Tensor] | None, dst: int, blocking: bool) -> Work:
        outputs = [staged(o, self._host_only) for o in outs] if outs is not None else []
        gathered = [[s for s, _ in outputs]] if self.rank == dst else []
        mine = staged(tensor, self._host_only)[0]
        work = self._engine.gather(gathered, [mine], _options(GatherOptions, rootRank=dst))
        return self._wrap("gather", work, lambda: [back() for _, back in outputs])

    def _start_scatter(self, tensor: torch.Tensor, ins: list[torch.Tensor] | None, src: int, blocking: bool) -> Work:
        t, back = staged(tensor, self._host_only)
        blocks = [[staged(i, self._host_only)[0] for i in ins]] if self.rank == src else []
        work = self._engine.scatter([t], blocks, _options(ScatterOptions, rootRank=src))
        return self._wrap("scatter", work, back)

    def _start_reduce_scatter(self, out: torch.Tensor, ins: list[torch.Tensor], op: ReduceOp, blocking: bool) -> Work:
        t, back = staged(out, self._host_only)
        blocks = [staged(i, self._host_only)[0] for i in ins]
        work = self._engine.reduce_scatter([t], [blocks], _reducing(ReduceScatterOptions, op))
        return self._wrap("reduce_scatter", work, lambda: (finish_(t, op, self.size), back()))

    def _start_all_to_all(self, outs: list[torch.Tensor], ins: list[torch.Tensor], blocking: bool) -> Work:
        # One flat exchange with split sizes: gloo's list form wants one size for every pair of ranks.
        sent = torch.cat([t.reshape(-1) for t in ins]).to(self._host_only or ins[0].device)
        got = torch.empty(sum(o.numel() for o in outs), dtype=sent.dtype, device=sent.device)
        work = self._engine.alltoall_base(got, sent, [o.numel() for o in outs], [t.numel() for t in ins],
                                          AllToAllOptions())

        def unpack() -> None:
            for out, block in zip(outs, torch.split(got, [o.numel() for o in outs]), strict=True):
                out.copy_(block.view(out.shape))

        return self._wrap("all_to_all", work, unpack)

    def _start_barrier(self, blocking: bool, timeout: timedelta | None = None) -> Work:
        # NCCL would otherwise guess the GPU from the rank, which is wrong in a subgroup.
        fields = {"device": self.device} if self.backend == "nccl" else {}
        if timeout is not None:
            fields["timeout"] = timeout
        return self._wrap("barrier", self._engine.barrier(_options(BarrierOptions, **fields)), timeout=timeout)

    def _start_send(self, tensor: torch.Tensor, dst: int, tag: int, blocking: bool) -> Work:
        work = self._engine.send([staged(tensor, self._host_only)[0]], dst, tag)
        return self._wrap("send", work, peer=self.ranks[dst], tag=tag)

    def _start_recv(self, tensor: torch.Tensor, src: int | None, tag: int, blocking: bool) -> Work:
        t, back = staged(tensor, self._host_only)
        if src is not None:
            return self._wrap("recv", self._engine.recv([t], src, tag), back, peer=self.ranks[src], tag=tag)
        work = self._engine.recv_anysource([t], tag)

        def landed() -> None:
            back()
            wrapped.received_from(self.ranks[work._source_rank()])

        wrapped = self._wrap("recv", work, landed, tag=tag)
        return wrapped

    def new_subgroup(self, ranks: Sequence[int], timeout: timedelta | None = None, *,
                     name: str | None = None) -> C10dProcessGroup | None:
        """Without a name, every member of this group calls it, in the same order: that order names the
        subgroup's part of the store. Only the subgroup's members build an engine."""
        if name is None:
            self._subgroups_made += 1
        if self.ranks[self.rank] not in ranks:
            return None
        part = f"sub{self._subgroups_made}/" if name is None else f"named/{name}/"
        return C10dProcessGroup(self.backend, self._store, self._name + part, list(ranks), self.ranks[self.rank],
                                timeout or self.timeout)

    def shutdown(self) -> None:
        recent, self._recent = self._recent, None
        if recent is not None:
            _held_until_exit.extend(recent)
        self._engine.shutdown()
