"""DistributedDataParallel: replicas of one module on every rank whose gradients are averaged in
buckets, each bucket's all-reduce starting while backward is still computing the rest.

    model = DistributedDataParallel(net)        # after shoal.distributed.init_process_group(...)
    loss_fn(model(x), y).backward()             # on return, every .grad is the mean over ranks
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.objects import all_gather_object
from shoal.observe import events
from shoal.parallel.buckets import Bucket, assign_buckets
from shoal.parallel.comm_hooks import GradBucket, Pending, allreduce_hook
from shoal.parallel.ddp_join import DDPJoinHook, _announce_step, _common_rank
from shoal.parallel.join import Join, Joinable

_FIRST_BUCKET_BYTES = 1 << 20
_forward_hooks: list[Callable[[DistributedDataParallel], None]] = []


def register_sync_forward_hook(hook: Callable[[DistributedDataParallel], None]) -> None:
    """Call `hook(replica)` at every forward that prepares a synchronized backward, for a layer above whose
    backward puts the gradients elsewhere than `.grad`: it must then call `replica.reduce_gradients`."""
    _forward_hooks.append(hook)


class DistributedDataParallel(nn.Module, Joinable):
    """Data-parallel wrapper with torch's constructor arguments and semantics.

    At construction every rank checks that it holds the same parameters (names, shapes, dtypes) and
    takes rank 0's parameters and buffers. In backward, a hook on each parameter marks its gradient
    in; a full bucket is all-reduced at once, asynchronously, in bucket order on every rank; when
    backward finishes, the buckets are awaited and `.grad` holds the averages. With the default
    communication hook on a group that coalesces for free (shoal's), a bucket's gradients are reduced
    where they lie, as one collective; otherwise (gloo, another hook, gradient_as_bucket_view, a
    gradient that is missing or laid out otherwise) they are packed into the bucket's buffer first
    and the averages copied back. A Joinable: `join()` trains on uneven inputs (see shoal.parallel.join).
    """

    def __init__(self, module: nn.Module, device_ids: list[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0, broadcast_buffers: bool = True,
                 process_group: ProcessGroup | None = None, bucket_cap_mb: float = 25,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False) -> None:
        super().__init__()
        Joinable.__init__(self)
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        import shoal.distributed as dist

        self.module = module
        self.device = _single_device(module, device_ids, output_device)
        self.dim = dim  # kept for torch's interface: one device per replica leaves nothing to scatter
        self.process_group = process_group if process_group is not None else dist.default_group()
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.gradient_as_bucket_view = gradient_as_bucket_view
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        _check_same_parameters(named, self.process_group)
        self._sync_from([*module.parameters(), *module.buffers()])  # every replica starts as rank 0
        cap = int(bucket_cap_mb * (1 << 20))
        assignment = assign_buckets([p for _, p in named], cap, min(cap, _FIRST_BUCKET_BYTES))
        self.buckets = [Bucket(b, [named[i][1] for i in members], [named[i][0] for i in members])
                        for b, members in enumerate(assignment)]
        self._hook: Callable[[Any, GradBucket], Pending] = allreduce_hook
        self._hook_state: Any = self.process_group
        self._require_sync = True
        self._step_syncs = True  # decided at forward, as torch does: no_sync() around forward is enough
        self._in_backward = False
        self._next_launch = 0
        # Per bucket in flight: wait for its reduction and get the averaged gradients, shaped as its parameters.
        self._inflight: list[Callable[[], list[torch.Tensor]] | None] = [None] * len(self.buckets)
        self.launched_in_backward = 0  # buckets whose reduction began before backward ended (last step)
        self._prepared = False  # forward has reset the buckets for the backward that follows it
        self._backward_started: events.Started | None = None  # for the timeline: when the first gradient came
        self._divide_by_initial_world_size = True  # under Join: else by the live ranks (set by its hook)
        # Under Join: how many ranks this step synchronizes (read once per step, at the first bucket).
        self._live_ranks: Callable[[], int] | None = None
        self._grad_hooks = [param.register_post_accumulate_grad_hook(self._make_grad_hook(bucket, i))
                            for bucket in self.buckets for i, param in enumerate(bucket.params)]

    # ---- set-up ------------------------------------------------------------------------------

    def _sync_from(self, tensors: list[torch.Tensor], src: int | None = None) -> None:
        """Overwrite `tensors` with global rank `src`'s (None: the group's rank 0's), in place."""
        src = self.process_group.ranks[0] if src is None else src
        with torch.no_grad():
            for tensor in tensors:
                self.process_group.broadcast(tensor, src).wait()

    def _syncs_buffers(self) -> bool:
        """Whether a synchronizing step takes one rank's buffers (a joined rank asks it too)."""
        return self.broadcast_buffers and self.process_group.size > 1 and next(self.module.buffers(), None) is not None

    def adopt(self, group: ProcessGroup) -> None:
        """Go on in `group`, the next generation's after a failure (shoal.elastic): the reductions the
        broken group left in flight are dropped, not awaited, and, as at construction, the replicas
        (a joiner's among them, new in `group`) check they wrap the same model and take the new rank
        0's parameters and buffers. A communication hook whose state holds the old group must be
        registered again."""
        if self._hook_state is self.process_group:
            self._hook_state = group
        self.process_group = group
        self._inflight = [None] * len(self.buckets)
        for bucket in self.buckets:
            bucket.reset()
        self._prepared = False
        _check_same_parameters([(n, p) for n, p in self.module.named_parameters() if p.requires_grad], group)
        self._sync_from([*self.module.parameters(), *self.module.buffers()])

    def release(self) -> None:
        """Stop averaging the module's gradients and taking rank 0's buffers (its passes are its own again,
        as after torch's DDP is deleted), so that another DistributedDataParallel may wrap it: a second
        training of the same model (shoal.elastic.LiveTraining.close calls it). Forward still runs the
        module, with no collective."""
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []
        self._require_sync = False

    def register_comm_hook(self, state: Any, hook: Callable[[Any, GradBucket], Pending]) -> None:
        """Replace how buckets are averaged (see `shoal.parallel.comm_hooks`); call before training."""
        self._hook_state, self._hook = state, hook

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block averages the sum."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    # ---- uneven inputs (Join) -----------------------------------------------------------------

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs: a rank out of batches shadows the others' steps until all are
        done, then every rank takes the model of the last to finish. Gradients are divided by the initial
        world size, or (divide_by_initial_world_size=False, default hook only) by the ranks still training."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> DDPJoinHook:
        """The hook that shadows this DDP's steps; takes `divide_by_initial_world_size` (default True)."""
        return DDPJoinHook(self, divide_by_initial_world_size=kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """The device of the module's first parameter: the join's collectives put their tensors there."""
        first = next(self.module.parameters(), None)
        if first is None:
            raise ValueError(f"DistributedDataParallel.join_device: the wrapped {type(self.module).__name__} has "
                             f"no parameters, so there is no device to put the join's collectives on; Join needs "
                             f"a module with parameters (torch's DistributedDataParallel refuses one without)")
        return first.device

    @property
    def join_process_group(self) -> ProcessGroup:
        return self.process_group

    # ---- forward and backward ----------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._step_syncs = self._require_sync
        syncs = self._step_syncs and torch.is_grad_enabled()
        self._live_ranks = None
        if self._join_config.enable:  # tell the ranks that have joined what to shadow (ddp_join.py)
            Join.notify_join_context(self)
            self._live_ranks = _announce_step(self, syncs)
        if syncs:
            self._prepare_for_backward()
            for hook in _forward_hooks:
                hook(self)
            # Only a step that will synchronize takes rank 0's buffers, so that evaluating on one rank
            # alone (no_grad) involves no collective. Under Join, rank 0 may have joined: the highest live rank's.
            if self._syncs_buffers():
                source = _common_rank(self, candidate=True) if self._join_config.enable else None
                self._sync_from(list(self.module.buffers()), source)
        if self.device is not None:  # as torch's DDP does for a module given its device: inputs follow it
            args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to(self.device, non_blocking=True), (args, kwargs))
        started = events.begin()
        output = self.module(*args, **kwargs)
        events.complete("forward", events.COMPUTE, started)
        return output

    def _prepare_for_backward(self) -> None:
        """Reset the buckets; reductions a failed backward left in flight are finished first, so the
        ranks' collectives stay paired."""
        if any(pending is not None for pending in self._inflight):
            self._drain()
        for bucket in self.buckets:
            bucket.reset()
        self._next_launch = 0
        self.launched_in_backward = 0
        self._in_backward = False
        self._prepared = True

    def _make_grad_hook(self, bucket: Bucket, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self._step_syncs:
                return
            if not self._in_backward:  # the first gradient of this backward
                if not self._prepared:
                    raise RuntimeError("DistributedDataParallel: each synchronized backward needs its own forward "
                                       "(a second backward through the same graph is not supported)")
                self._prepared = False
                self._in_backward = True
                self._backward_started = events.begin()
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            if bucket.mark_ready(i):
                self._launch_ready(_grad_of, in_backward=True)
        return hook

    def _launch_ready(self, read: Callable[[torch.Tensor], torch.Tensor | None], *, in_backward: bool) -> None:
        """Start the reductions of ready buckets, strictly in bucket order, as every rank does; `read`
        gives a parameter's gradient (None: it has none here)."""
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            bucket = self.buckets[self._next_launch]
            self._inflight[bucket.index] = self._reduce(bucket, [read(p) for p in bucket.params])
            if events.active():
                events.instant(f"bucket {bucket.index} launched", events.DDP, in_backward=in_backward,
                               bytes=bucket.offsets[-1] * bucket.params[0].element_size())
            self._next_launch += 1
            self.launched_in_backward += in_backward

    def _reduce(self, bucket: Bucket, grads: list[torch.Tensor | None]) -> Callable[[], list[torch.Tensor]]:
        """Start averaging a bucket; the returned function waits and gives the averages. Under Join with
        divide_by_initial_world_size=False, the default hook's mean is rescaled to one over the live ranks
        (joined ones add zeros), as torch's reducer divides then; other hooks divide as they will, as in torch."""
        results = self._start_reduction(bucket, grads)
        if self._live_ranks is None or self._divide_by_initial_world_size or self._hook is not allreduce_hook:
            return results
        scale = (self._hook_state or self.process_group).size / self._live_ranks()  # waits at the first bucket only
        return lambda: [result.mul_(scale) for result in results()]

    def _start_reduction(self, bucket: Bucket, grads: list[torch.Tensor | None]) -> Callable[[], list[torch.Tensor]]:
        group = self._hook_state or self.process_group
        if (self._hook is allreduce_hook and group.coalesces_for_free and not self.gradient_as_bucket_view
                and all(_plain_cpu_tensor(g) for g in grads)):
            work = group.all_reduce_coalesced([g.view(-1) for g in grads], ReduceOp.AVG)

            def reduced_in_place() -> list[torch.Tensor]:
                work.wait()
                return grads
            return reduced_in_place
        for i, grad in enumerate(grads):
            view = bucket.view(i)
            if grad is None:
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():  # already there when .grad is the bucket's view
                view.copy_(grad)
        pending = self._hook(self._hook_state, GradBucket(bucket, bucket.buffer, self.process_group,
                                                          last=bucket.index == len(self.buckets) - 1))

        def packed_results() -> list[torch.Tensor]:
            flat = pending.wait()
            if flat.data_ptr() != bucket.buffer.data_ptr() and (self.gradient_as_bucket_view
                                                                or flat.dtype != bucket.buffer.dtype):
                # The hook answered elsewhere, where .grad is to view the bucket, or in another dtype (as
                # torch's compress wrappers do): into the bucket, in the gradients' dtype.
                flat = bucket.buffer.copy_(flat)
            return bucket.split(flat)
        return packed_results

    def _finish_backward(self) -> None:
        """Runs once autograd has finished this backward: reduce what is left, wait, write `.grad`."""
        self._in_backward = False
        events.complete("backward", events.COMPUTE, self._backward_started)
        self._backward_started = None
        self._complete_reduction(_grad_of, self._write_grad)

    def _write_grad(self, param: torch.Tensor, result: torch.Tensor) -> None:
        if param.grad is not None and param.grad.data_ptr() == result.data_ptr():
            return  # reduced where it lies
        if self.gradient_as_bucket_view:
            param.grad = result  # the bucket's view: later backwards accumulate there, and nothing is copied
        elif param.grad is None:
            param.grad = result.clone()
        else:
            param.grad.copy_(result)

    def awaits_reduction(self) -> bool:
        """Whether the last forward prepared a synchronized backward whose gradients no backward has
        reduced yet, as happens when they go elsewhere than `.grad` (see `reduce_gradients`)."""
        return self._prepared and self._step_syncs

    def reduce_gradients(self, grads: dict[torch.Tensor, torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
        """Average gradients held outside `.grad` (a backward that keeps them elsewhere) over the replicas,
        with the same buckets, order and communication hook as a backward; every rank must call it
        for the same forward. Returns {parameter: averaged gradient}, for every parameter with a
        gradient on some rank."""
        self._prepared = False
        for bucket in self.buckets:
            for i, param in enumerate(bucket.params):
                if param in grads:
                    bucket.mark_ready(i)
        averaged: dict[torch.Tensor, torch.Tensor] = {}
        self._complete_reduction(grads.get, lambda param, result: averaged.__setitem__(param, result.clone()))
        return averaged

    def _complete_reduction(self, read: Callable[[torch.Tensor], torch.Tensor | None],
                            write: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Reduce every bucket not reduced yet, with the gradients `read` gives (for a parameter this
        backward did not reach, one accumulated under no_sync(), or none), wait, and hand each averaged
        gradient to `write`."""
        unused = [(b, i) for b in self.buckets for i, ready in enumerate(b.ready) if not ready]
        for bucket, i in unused:
            bucket.mark_ready(i)
        self._launch_ready(read, in_backward=False)  # every bucket, on every rank: collectives stay paired
        if unused and not self.find_unused_parameters:
            self._drain()
            names = [b.names[i] for b, i in unused]
            raise RuntimeError(f"rank {self.process_group.rank}: parameters {names} got no gradient in this "
                               f"backward; pass find_unused_parameters=True to DistributedDataParallel if "
                               f"parts of the model may be skipped")
        used = None
        if self.find_unused_parameters:
            # A parameter without a gradient here may have one elsewhere: only one that has none on any
            # rank keeps grad None, as it would in one process.
            flags = torch.tensor([0 if read(p) is None else 1 for b in self.buckets for p in b.params],
                                 dtype=torch.int32, device=self.process_group.device)
            self.process_group.all_reduce(flags).wait()
            used = iter(flags.tolist())
        for bucket, results in zip(self.buckets, self._drain(), strict=True):
            for param, result in zip(bucket.params, results, strict=True):
                globally_used = True if used is None else next(used) > 0
                if globally_used:
                    write(param, result)

    def _drain(self) -> list[list[torch.Tensor]]:
        """Wait for the reductions in flight; each bucket's averaged gradients, shaped as its parameters."""
        results = [wait() for wait in self._inflight if wait is not None]
        self._inflight = [None] * len(self.buckets)
        return results


def _grad_of(param: torch.Tensor) -> torch.Tensor | None:
    return param.grad


def _plain_cpu_tensor(grad: torch.Tensor | None) -> bool:
    """Whether a gradient can be reduced where it lies: dense, contiguous, on the CPU (a GPU tensor
    would be staged one by one), no lazy conjugate or negation, and outside autograd."""
    return (grad is not None and grad.layout == torch.strided and grad.device.type == "cpu" and grad.is_contiguous()
            and not grad.requires_grad and not grad.is_conj() and not grad.is_neg())


def _single_device(module: nn.Module, device_ids: list[int | torch.device] | None,
                   output_device: int | torch.device | None) -> torch.device | None:
    """The device named by torch's `device_ids`/`output_device`, checked against the module's, as torch checks them.

    A CPU module takes neither (torch's CPU form passes None); a module on one GPU may name that
    GPU, and then its inputs are moved there. One replica per process: a list of several devices is refused.
    """
    if device_ids is None:
        if output_device is not None:
            raise ValueError(f"output_device {output_device!r} given without device_ids")
        return None
    devices = {p.device for p in module.parameters()}
    wanted = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in device_ids]
    if len(wanted) != 1 or devices != {wanted[0]} or wanted[0].type == "cpu":
        raise ValueError(f"device_ids {device_ids!r} must name the one GPU the module's parameters are on, "
                         f"and be None for a CPU module; the parameters are on {sorted(map(str, devices))}")
    return wanted[0]


def _check_same_parameters(named: list[tuple[str, torch.Tensor]], group: ProcessGroup) -> None:
    """Raise on every rank, naming the parameter and the ranks, if replicas differ in structure."""
    specs: list[Any] = [None] * group.size
    all_gather_object(group, specs, [[n, list(p.shape), str(p.dtype)] for n, p in named])
    for rank, spec in enumerate(specs):
        if spec == specs[0]:
            continue
        for index in range(max(len(spec), len(specs[0]))):
            theirs = spec[index] if index < len(spec) else None
            ours = specs[0][index] if index < len(specs[0]) else None
            if theirs != ours:
                raise ValueError(f"DistributedDataParallel: parameter #{index} differs between ranks "
                                 f"{group.ranks[0]} ({_describe(ours)}) and {group.ranks[rank]} "
                                 f"({_describe(theirs)}); every rank must wrap the same model")


def _describe(spec: list | None) -> str:
    return "absent" if spec is None else f"{spec[0]}: {spec[2].removeprefix('torch.')}{spec[1]}"
