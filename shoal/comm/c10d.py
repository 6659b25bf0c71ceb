"""ProcessGroup that delegates to torch.distributed (backend "gloo" on CPUs, "nccl" on GPUs), so every
shoal feature also runs on PyTorch's own engine by changing one argument."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as tdist

from shoal.comm.group import ProcessGroup
from shoal.comm.reduce_op import ReduceOp, finish_
from shoal.comm.staging import staged
from shoal.comm.store import Store
from shoal.comm.work import Work
from shoal.errors import PeerFailure

_TORCH_OPS = {
    ReduceOp.SUM: tdist.ReduceOp.SUM,
    ReduceOp.AVG: tdist.ReduceOp.SUM,  # averaged after the sum: gloo has no AVG
    ReduceOp.PRODUCT: tdist.ReduceOp.PRODUCT,
    ReduceOp.MIN: tdist.ReduceOp.MIN,
    ReduceOp.MAX: tdist.ReduceOp.MAX,
}
_PEER_LOST_HINTS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
# A Gloo worker thread drops its reference to an operation just after completing it. If that is the last
# reference, it frees the operation's tensors there, which takes the GIL; once the interpreter is
# finalizing, taking the GIL ends the thread inside C++ and aborts the process ("terminate called without
# an active exception"). Torch keeps process groups alive past destroy_process_group once torch._dynamo
# is imported (torch.optim does), so their threads run on to the very end. Each Gloo group therefore
# holds its last operations (more than its two workers can be finishing at once), and at shutdown hands
# them to this list, which only the interpreter's own teardown frees, on its main thread: a worker's
# drop of a recent operation is then not the last. An operation still running at exit is not covered.
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


class C10dProcessGroup(ProcessGroup):
    def __init__(self, backend: str, pg, ranks: Sequence[int], global_rank: int, timeout: timedelta,
                 *, is_world: bool) -> None:
        super().__init__(ranks, global_rank, timeout)
        self.backend = backend
        self._pg = pg
        self._is_world = is_world
        # See _held_until_exit (seen with Gloo; NCCL's teardown is its own).
        self._recent: collections.deque | None = collections.deque(maxlen=_RECENT_OPS) if backend == "gloo" else None

    @classmethod
    def create(cls, backend: str, store: Store, rank: int, world_size: int,
               timeout: timedelta) -> C10dProcessGroup:
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA GPUs; use backend 'gloo' or 'shoal' on CPUs")
        if tdist.is_initialized():
            raise RuntimeError("torch.distributed already has a default process group; destroy it first")
        tdist.init_process_group(backend, store=tdist.PrefixStore(store.prefix + "c10d/", store.raw),
                                 rank=rank, world_size=world_size, timeout=timeout)
        return cls(backend, tdist.group.WORLD, range(world_size), rank, timeout, is_world=True)

    def _wrap(self, name: str, work, then: Callable[[], None] = lambda: None) -> Work:
        if self._recent is not None:
            self._recent.append(work)
        return _TorchWork(name, self.timeout, work, then)

    def _start_all_reduce(self, tensor: torch.Tensor, op: ReduceOp, blocking: bool) -> Work:
        t, back = staged(tensor)
        work = tdist.all_reduce(t, _TORCH_OPS[op], group=self._pg, async_op=True)
        return self._wrap("all_reduce", work, lambda: (finish_(t, op, self.size), back()))

    def _start_all_reduce_coalesced(self, tensors: list[torch.Tensor], op: ReduceOp, blocking: bool) -> Work:
        flat = torch.cat([t.reshape(-1) for t in tensors])

        def then() -> None:
            finish_(flat, op, self.size)
            for tensor, piece in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                tensor.copy_(piece.view_as(tensor))

        work = tdist.all_reduce(flat, _TORCH_OPS[op], group=self._pg, async_op=True)
        return self._wrap("all_reduce", work, then)

    def _start_broadcast(self, tensor: torch.Tensor, src: int, blocking: bool) -> Work:
        t, back = staged(tensor)
        return self._wrap("broadcast", tdist.broadcast(t, self.ranks[src], group=self._pg, async_op=True), back)

    def _start_reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, blocking: bool) -> Work:
        # gloo's reduce scribbles over non-root inputs; reduce a copy there so they stay as they were.
        t, back = staged(tensor) if self.rank == dst else (tensor.clone(), lambda: None)
        work = tdist.reduce(t, self.ranks[dst], _TORCH_OPS[op], group=self._pg, async_op=True)
        done = (lambda: (finish_(t, op, self.size), back())) if self.rank == dst else (lambda: None)
        return self._wrap("reduce", work, done)

    def _start_all_gather(self, outs: list[torch.Tensor], tensor: torch.Tensor, blocking: bool) -> Work:
        outputs = [staged(o) for o in outs]
        work = tdist.all_gather([s for s, _ in outputs], tensor.contiguous(), group=self._pg, async_op=True)
        return self._wrap("all_gather", work, lambda: [back() for _, back in outputs])

    def _start_gather(self, tensor: torch.Tensor, outs: list[torch.Tensor] | None, dst: int, blocking: bool) -> Work:
        outputs = [staged(o) for o in outs] if outs is not None else []
        work = tdist.gather(tensor.contiguous(), [s for s, _ in outputs] if outs is not None else None,
                            dst=self.ranks[dst], group=self._pg, async_op=True)
        return self._wrap("gather", work, lambda: [back() for _, back in outputs])

    def _start_scatter(self, tensor: torch.Tensor, ins: list[torch.Tensor] | None, src: int, blocking: bool) -> Work:
        t, back = staged(tensor)
        blocks = [i.contiguous() for i in ins] if ins is not None else None
        work = tdist.scatter(t, blocks, src=self.ranks[src], group=self._pg, async_op=True)
        return self._wrap("scatter", work, back)

    def _start_reduce_scatter(self, out: torch.Tensor, ins: list[torch.Tensor], op: ReduceOp, blocking: bool) -> Work:
        t, back = staged(out)
        if self.backend == "gloo":
            # gloo has no reduce_scatter; a full all-reduce of the concatenation gives the same result.
            whole = torch.cat([i.reshape(-1) for i in ins])
            work = tdist.all_reduce(whole, _TORCH_OPS[op], group=self._pg, async_op=True)

            def done() -> None:
                t.view(-1).copy_(whole[self.rank * t.numel():(self.rank + 1) * t.numel()])
                finish_(t, op, self.size)
                back()

            return self._wrap("reduce_scatter", work, done)
        work = tdist.reduce_scatter(t, [i.contiguous() for i in ins], _TORCH_OPS[op], group=self._pg,
                                    async_op=True)
        return self._wrap("reduce_scatter", work, lambda: (finish_(t, op, self.size), back()))

    def _start_all_to_all(self, outs: list[torch.Tensor], ins: list[torch.Tensor], blocking: bool) -> Work:
        # One flat exchange with split sizes: gloo's list form wants one size for every pair of ranks.
        sent = torch.cat([t.reshape(-1) for t in ins])
        got = torch.empty(sum(o.numel() for o in outs), dtype=sent.dtype, device=sent.device)
        work = tdist.all_to_all_single(got, sent, [o.numel() for o in outs], [t.numel() for t in ins],
                                       group=self._pg, async_op=True)

        def unpack() -> None:
            for out, block in zip(outs, torch.split(got, [o.numel() for o in outs]), strict=True):
                out.copy_(block.view(out.shape))

        return self._wrap("all_to_all", work, unpack)

    def _start_barrier(self, blocking: bool) -> Work:
        return self._wrap("barrier", tdist.barrier(group=self._pg, async_op=True))

    def _start_send(self, tensor: torch.Tensor, dst: int, tag: int, blocking: bool) -> Work:
        work = tdist.isend(tensor.contiguous(), self.ranks[dst], group=self._pg, tag=tag)
        return self._wrap(f"send to rank {self.ranks[dst]}", work)

    def _start_recv(self, tensor: torch.Tensor, src: int, tag: int, blocking: bool) -> Work:
        t, back = staged(tensor)
        work = tdist.irecv(t, self.ranks[src], group=self._pg, tag=tag)
        return self._wrap(f"recv from rank {self.ranks[src]}", work, back)

    def new_subgroup(self, ranks: Sequence[int]) -> C10dProcessGroup | None:
        pg = tdist.new_group(list(ranks), timeout=self.timeout, backend=self.backend)
        if self.ranks[self.rank] not in ranks:
            return None
        return C10dProcessGroup(self.backend, pg, sorted(ranks), self.ranks[self.rank], self.timeout,
                                is_world=False)

    def shutdown(self) -> None:
        recent, self._recent = self._recent, None
        if recent is not None:
            _held_until_exit.extend(recent)
        if tdist.is_initialized():
            tdist.destroy_process_group(None if self._is_world else self._pg)
