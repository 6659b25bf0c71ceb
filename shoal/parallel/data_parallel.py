"""DataParallel: one process, one thread per replica. Each forward splits the batch, replicates the module,
runs the replicas side by side and gathers their outputs; backward runs the replicas side by side too.

    model = DataParallel(net)                   # as many replicas as this process has cores
    model = DataParallel(net, replicas=2)       # or say how many
    loss_fn(model(x), y).backward()             # net's .grad: as if net had seen the whole batch

On CPU a replica is cheap: it shares the module's parameter memory, and only its leaves are its own,
so each replica's gradients can be computed apart from the others' and summed into the parameters.
PyTorch's nn.DataParallel on CPU runs the module once, on one thread; on GPUs it runs the replicas'
backward in the autograd engine's per-device threads. Here the replicas' backward is run by one
thread per replica too, which is what lets a CPU DataParallel use several cores. Replicas are CPU
threads only: on GPUs, DistributedDataParallel (one process per GPU) is the tool.
Torch operations release the GIL, so replicas overlap inside large operators; Python code between
operators does not overlap, which is why DistributedDataParallel's processes win on small layers.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils._pytree import tree_flatten, tree_unflatten

# With OpenMP (Linux builds), torch.set_num_threads sets the calling thread's own count of intra-op threads.
_PER_THREAD_INTRA_OP = torch.backends.openmp.is_available()


class DataParallel(nn.Module):
    """torch.nn.DataParallel's interface, for CPU replicas: `replicas` of them (default: the cores this
    process may run on); `device_ids` and `output_device` may only be None (or "cpu")."""

    def __init__(self, module: nn.Module, device_ids: Sequence[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0, *, replicas: int | None = None) -> None:
        super().__init__()
        self.module = module
        self.dim = dim
        if device_ids is not None or output_device not in (None, "cpu", torch.device("cpu")):
            raise ValueError(f"shoal's DataParallel runs its replicas on CPU threads (device_ids=None, replicas=N), "
                             f"got device_ids={device_ids!r}, output_device={output_device!r}; on GPUs use "
                             f"DistributedDataParallel, one process per GPU")
        self.replicas = replicas if replicas is not None else len(os.sched_getaffinity(0))
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        self._threads: _ReplicaThreads | None = None

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        flat, spec = tree_flatten((inputs, kwargs))
        positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        pieces = {i: flat[i].chunk(self.replicas, self.dim) for i in positions}
        counts = {len(p) for p in pieces.values()}
        if len(counts) > 1:  # torch would drop the longer inputs' last pieces without a word
            raise ValueError(f"DataParallel splits every tensor argument along dim {self.dim} into the same number "
                             f"of pieces; these sizes give different numbers: "
                             f"{[tuple(flat[i].shape) for i in positions]}")
        count = counts.pop() if counts else 1
        if count == 1:  # one replica's worth of work (or no batch to split): no threads needed
            return self.module(*inputs, **kwargs)
        step = _Step(self, flat, spec, pieces, count)
        tensors = [flat[i] for i in positions]
        needs_graph = torch.is_grad_enabled() and any(t.requires_grad for t in [*tensors, *step.params])
        if not needs_graph:
            return tree_unflatten(step.run(build_graph=False), step.out_spec)
        outputs = _Replicated.apply(step, len(tensors), *tensors, *step.params)
        return tree_unflatten(list(outputs), step.out_spec)

    def _run(self, jobs: list[Callable[[], Any]]) -> list:
        # Started at first use, so a model built and never run starts none; again in a forked child, which
        # has none of its parent's threads.
        if self._threads is None or self._threads.made_in != os.getpid():
            self._threads = _ReplicaThreads(self.replicas)
        return self._threads.run(jobs)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_threads"] = None  # threads do not travel; a copy starts its own
        return state


class _Step:
    """One forward of a DataParallel: the replicas' inputs, their outputs and the graphs between them."""

    def __init__(self, owner: DataParallel, flat: list, spec: Any, pieces: dict[int, tuple[torch.Tensor, ...]],
                 count: int) -> None:
        self.owner = owner
        self.count = count  # replicas this step runs: fewer than the owner's when the batch is short
        self.params = list(owner.module.parameters())
        self.flat, self.spec, self.pieces = flat, spec, pieces
        self.out_spec: Any = None
        self.leaves: list[list[torch.Tensor]] = []  # per replica: its input pieces, then its parameters
        self.outputs: list[list[Any]] = []  # per replica: its flat outputs

    def run(self, build_graph: bool) -> list:
        """Run every replica on its piece of the batch; return the gathered flat outputs."""
        results = self.owner._run([self._replica_job(r, build_graph) for r in range(self.count)])
        self.leaves = [leaves for leaves, _ in results]
        self.outputs = [outputs for _, (outputs, _) in results]
        self.out_spec = results[0][1][1]
        return [self._gather(j) for j in range(len(self.outputs[0]))]

    def _replica_job(self, r: int, build_graph: bool) -> Callable[[], tuple]:
        # The other replicas' copies of the buffers are taken here, before any replica runs: the first one
        # updates the module's own in place (BatchNorm's running statistics) while the others start. Not as
        # inference tensors (under the caller's inference_mode): the replicas' threads update them outside it.
        copies = None
        if r != 0 and self.owner.training:
            with torch.inference_mode(False):
                copies = {b: b.clone() for b in self.owner.module.buffers()}

        def job() -> tuple:
            inputs = {i: _leaf(p[r]) for i, p in self.pieces.items()}
            aliases = {p: _leaf(p) for p in self.params}
            replica = _replicate(self.owner.module, aliases, copies)
            args, kwargs = tree_unflatten([inputs.get(i, x) for i, x in enumerate(self.flat)], self.spec)
            with torch.set_grad_enabled(build_graph):
                outputs, out_spec = tree_flatten(replica(*args, **kwargs))
            return [*inputs.values(), *(aliases[p] for p in self.params)], (outputs, out_spec)
        return job

    def differentiable(self, j: int) -> bool:
        return any(outputs[j].requires_grad for outputs in self.outputs)

    def _gather(self, j: int) -> torch.Tensor:
        parts = [outputs[j] for outputs in self.outputs]
        if not all(isinstance(part, torch.Tensor) for part in parts):
            raise TypeError(f"DataParallel gathers tensors (in tuples, lists, dicts) only; replica outputs were "
                            f"{[type(part).__name__ for part in parts]}")
        parts = [part.detach() for part in parts]
        if parts[0].dim() == 0:  # a scalar per replica (a loss computed inside the module): a vector of them
            return torch.stack(parts)
        return torch.cat(parts, self.owner.dim)

    def backward(self, grads: Sequence[torch.Tensor | None], inputs: int) -> list[torch.Tensor | None]:
        """The gradients of the step's inputs (`inputs` of them) and the module's parameters."""
        per_replica = self.owner._run([self._replica_backward(r, grads) for r in range(self.count)])
        input_grads = [self._join_pieces(k, [g[k] for g in per_replica]) for k in range(inputs)]
        param_grads: list[torch.Tensor | None] = [None] * len(self.params)

        def summer(share: list[int]) -> Callable[[], None]:
            def job() -> None:
                for k in share:
                    param_grads[k] = _sum([g[inputs + k] for g in per_replica])
            return job

        # Summing the replicas' gradients is a pass over every parameter: the threads share it out.
        self.owner._run([summer(share) for share in _shares(self.params, self.count)])
        return [*input_grads, *param_grads]

    def _replica_backward(self, r: int, grads: Sequence[torch.Tensor | None]) -> Callable[[], list]:
        def job() -> list:
            roots, root_grads = [], []
            for j, (output, grad) in enumerate(zip(self.outputs[r], grads, strict=True)):
                if grad is None or not output.requires_grad:
                    continue
                roots.append(output)
                root_grads.append(self._piece_of(grad, j, r))
            leaves = [leaf for leaf in self.leaves[r] if leaf.requires_grad]
            if not roots or not leaves:
                return [None] * len(self.leaves[r])
            # Kept for a second backward through the same outputs; freed with the caller's graph.
            found = iter(torch.autograd.grad(roots, leaves, root_grads, allow_unused=True, retain_graph=True))
            return [next(found) if leaf.requires_grad else None for leaf in self.leaves[r]]
        return job

    def _piece_of(self, grad: torch.Tensor, j: int, r: int) -> torch.Tensor:
        if self.outputs[r][j].dim() == 0:
            return grad[r]
        start = sum(outputs[j].shape[self.owner.dim] for outputs in self.outputs[:r])
        return grad.narrow(self.owner.dim, start, self.outputs[r][j].shape[self.owner.dim])

    def _join_pieces(self, k: int, grads: list[torch.Tensor | None]) -> torch.Tensor | None:
        if all(g is None for g in grads):
            return None
        pieces = list(self.pieces.values())[k]
        return torch.cat([torch.zeros_like(p) if g is None else g for p, g in zip(pieces, grads, strict=True)],
                         self.owner.dim)


class _Replicated(torch.autograd.Function):
    """The replicas as one node of the caller's graph: its backward runs theirs, one thread each."""

    @staticmethod
    def forward(ctx: Any, step: _Step, inputs: int, *tensors: torch.Tensor) -> tuple:
        ctx.step, ctx.inputs = step, inputs
        ctx.set_materialize_grads(False)
        outputs = step.run(build_graph=True)
        ctx.mark_non_differentiable(*[o for j, o in enumerate(outputs) if not step.differentiable(j)])
        return tuple(outputs)

    @staticmethod
    @once_differentiable  # the replicas' graphs end at their own leaves: no double backward through them
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        return (None, None, *ctx.step.backward(grads, ctx.inputs))


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    """A replica's own leaf over `tensor`'s data (no copy), so that its gradient is its own."""
    return tensor.detach().requires_grad_(tensor.requires_grad)


def _replicate(module: nn.Module, aliases: dict[nn.Parameter, torch.Tensor],
               buffer_copies: dict[torch.Tensor, torch.Tensor] | None) -> nn.Module:
    """A shallow copy of the module tree whose parameters are `aliases`; its buffers the module's own
    (`buffer_copies` None), or their copies.

    Shared buffers see in-place updates (BatchNorm's running statistics); the first replica shares
    them, like the replica on torch's first device, and the others' updates are dropped, as in torch.
    """
    copies: dict[nn.Module, nn.Module] = {m: m._replicate_for_data_parallel() for m in module.modules()}
    for original, replica in copies.items():
        for name, param in original._parameters.items():
            setattr(replica, name, None if param is None else aliases[param])
        for name, buffer in original._buffers.items():
            if buffer is not None and buffer_copies is not None:
                replica._buffers[name] = buffer_copies[buffer]
        for name, child in original._modules.items():
            replica._modules[name] = None if child is None else copies[child]
    return copies[module]


def _sum(grads: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [g for g in grads if g is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    total = present[0] + present[1]  # a new tensor: a gradient may be a view of the one flowing in
    for g in present[2:]:
        total += g
    return total


def _shares(params: list[nn.Parameter], count: int) -> list[list[int]]:
    """The parameters' indices dealt into `count` shares of about equal size, largest first."""
    shares: list[list[int]] = [[] for _ in range(count)]
    sizes = [0] * count
    for k in sorted(range(len(params)), key=lambda k: -params[k].numel()):
        smallest = sizes.index(min(sizes))
        shares[smallest].append(k)
        sizes[smallest] += params[k].numel()
    return shares


class _ReplicaThreads:
    """One thread per replica, each with its own inbox: a pool could hand several replicas to one thread."""

    def __init__(self, count: int) -> None:
        self.made_in = os.getpid()
        self._inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(count)]
        threads = [threading.Thread(target=_serve, args=(inbox,), name=f"shoal-dp-replica-{i}", daemon=True)
                   for i, inbox in enumerate(self._inboxes)]
        for thread in threads:
            thread.start()
        # Also at exit: a daemon thread still alive when the interpreter tears down can abort the process.
        weakref.finalize(self, _stop, self._inboxes, threads)

    def run(self, jobs: list[Callable[[], Any]]) -> list:
        """Run job i on thread i and return the results; a failure is raised once all have finished,
        the lowest replica's first.

        Each thread gets its share of the caller's intra-op threads, so replicas do not oversubscribe
        the cores (on OpenMP builds, where that setting belongs to the thread).
        """
        callers = torch.get_num_threads()
        counts = (max(1, callers // len(jobs)), callers) if _PER_THREAD_INTRA_OP else None
        futures: list[Future] = []
        for inbox, job in zip(self._inboxes, jobs, strict=False):  # fewer jobs than threads: a short batch
            futures.append(Future())
            inbox.put((job, counts, futures[-1]))
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]
        return [f.result() for f in futures]


def _serve(inbox: queue.SimpleQueue) -> None:
    while (work := inbox.get()) is not None:
        job, counts, future = work
        if counts is not None:
            torch.set_num_threads(counts[0])
        try:
            future.set_result(job())
        except BaseException as exc:
            future.set_exception(exc)
        finally:
            if counts is not None:  # the count is also the default for threads started later: put it back
                torch.set_num_threads(counts[1])


def _stop(inboxes: list[queue.SimpleQueue], threads: list[threading.Thread]) -> None:
    for inbox in inboxes:
        inbox.put(None)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join()
