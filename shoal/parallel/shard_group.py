"""The parameters of one `fully_shard` call, stored as this rank's rows and gathered whole only while used.

Each parameter is cut along dim 0 into world-size blocks of ceil(rows / world) rows (the last ones may be
short or empty), as FSDP2 does. A rank keeps its block as the `nn.Parameter` its module shows and its
optimizer steps. One all-gather of a flat buffer (every parameter's block, padded to full length, side by
side) makes the whole parameters; one reduce-scatter of the gradients laid out the same way gives each rank
the mean gradient of its rows.

The whole parameter is one `nn.Parameter` per parameter for the life of the module: autograd saves it in
forward and reads it in backward, so it keeps its identity while its storage is freed (resized to 0 bytes)
between uses and gathered again before backward. It is written through `.data`, whose version counter is
its own, so refilling it is not an in-place change autograd would refuse.

Under live recovery the group is not known when the model is sharded: the group starts unbound (one rank
holding every row) and `recut` gives it each generation's group and this rank's rows of the new layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.backends.group import ProcessGroup
from shoal.comm.backends.work import Work


@dataclass
class ShardedParam:
    """One parameter: where it is registered, its shard, its whole form, and its place in the flat buffer."""

    module: nn.Module
    name: str
    path: str  # its name under the fully_shard module, the state dict's key less the module's prefix
    shard: nn.Parameter
    full: nn.Parameter
    rows: int  # rows per rank's block (padded)
    row_numel: int
    offset: int  # where its block starts in a rank's part of the flat buffer

    def block(self, rank: int) -> slice:
        """The rows of the whole parameter that `rank` holds."""
        return block_rows(self.full.shape[0], self.rows, rank)

    def flat(self, rank: int) -> slice:
        """Where `rank`'s rows sit in a rank's part of the flat buffer (without the padding)."""
        rows = self.block(rank)
        return slice(self.offset, self.offset + (rows.stop - rows.start) * self.row_numel)

    def register(self, param: nn.Parameter) -> None:
        self.module._parameters[self.name] = param


def block_rows(total: int, per_block: int, block: int) -> slice:
    """The rows of a `total`-row parameter in `block`, when each block holds `per_block` (ceil(total / blocks))."""
    start = min(block * per_block, total)
    return slice(start, min(start + per_block, total))


def _free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _allocate(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())


class ShardGroup:
    """Gathers and frees the whole parameters of one module, and reduce-scatters their gradients."""

    def __init__(self, named: list[tuple[str, nn.Module, str, nn.Parameter]], group: ProcessGroup | None) -> None:
        self.group = group  # None: unbound until LiveTraining recuts it over a generation's group
        self.world, self.rank = (group.size, group.rank) if group is not None else (1, 0)
        dtypes = {param.dtype for *_, param in named}
        if len(dtypes) > 1:
            raise ValueError(f"fully_shard: one call shards parameters of one dtype (it gathers them as one "
                             f"buffer); got {sorted(map(str, dtypes))}: call fully_shard on the submodules whose "
                             f"parameters differ")
        self.params: list[ShardedParam] = []
        for path, module, name, param in named:
            if param.dim() == 0:
                raise ValueError(f"fully_shard cannot shard the 0-dimensional parameter {path!r}: it shards "
                                 f"along dim 0; give it shape [1]")
            full = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=param.device),
                                requires_grad=param.requires_grad)
            _free(full)
            shard = nn.Parameter(param.detach(), requires_grad=param.requires_grad)
            slot = ShardedParam(module, name, path, shard, full, 0, math.prod(param.shape[1:]), 0)
            slot.register(slot.shard)
            self.params.append(slot)
        self._lay_out()
        for slot in self.params:
            slot.shard.data = slot.shard.data[slot.block(self.rank)].clone()
        self.dtype = next(iter(dtypes)) if dtypes else torch.float32
        self.device = named[0][3].device if named else torch.device("cpu")
        self.gathered = False
        self._gathering: tuple[Work, torch.Tensor] | None = None
        self._reducing: tuple[Work, torch.Tensor, list[ShardedParam]] | None = None
        self._awaiting: set[int] | None = None  # the ids of the whole parameters whose gradient is still to come
        # Told of each collective this group starts: ("gather",) or ("reduce", the parameters with gradients).
        # A rank that has run out of inputs under Join makes the same ones again (fully_shard_join.py).
        self.started: Callable[[tuple], None] = lambda op: None
        # Called once every whole parameter that trains has its gradient of this backward.
        self.gradients_ready: Callable[[], None] = lambda: None
        self._hooked: set[int] = set()  # the whole parameters whose gradient accumulation is watched

    def _lay_out(self) -> None:
        """Each parameter's rows per block, and where its block sits in a rank's part of the flat buffer."""
        offset = 0
        for slot in self.params:
            slot.rows = math.ceil(slot.full.shape[0] / self.world)
            slot.offset = offset
            offset += slot.rows * slot.row_numel
        self.part_numel = offset  # one rank's part of the flat buffer

    def recut(self, group: ProcessGroup, shards: list[torch.Tensor]) -> None:
        """Go on over `group` (a new generation's), holding `shards`: this rank's rows of each parameter in
        the new layout. What was in flight on the old group is dropped unawaited (that group is broken or
        done), and the whole parameters are freed; the shards keep their identity (the optimizer's keys)."""
        self._gathering = self._reducing = self._awaiting = None
        self.reshard()
        self.group, self.world, self.rank = group, group.size, group.rank
        self._lay_out()
        for slot, rows in zip(self.params, shards, strict=True):
            slot.shard.data, slot.shard.grad = rows, None

    # --- gathering -----------------------------------------------------------------------------------------

    def start_gather(self) -> None:
        """Start gathering the whole parameters (a no-op while they are gathered or being gathered)."""
        if self.gathered or self._gathering is not None or not self.params:
            return
        self._gathering = self._gather(async_op=True)
        self.started(("gather",))

    def finish_gather(self) -> None:
        """Make the whole parameters the module's, waiting for their gather (started here if it was not)."""
        if self.gathered or not self.params:
            return
        self.start_gather()
        assert self._gathering is not None
        work, everyone = self._gathering
        work.wait()
        self._gathering = None
        for slot in self.params:
            _allocate(slot.full)
        self._copy_out(everyone, [slot.full.data for slot in self.params])
        for slot in self.params:
            self._train_as_shard(slot)
            slot.register(slot.full)
        self.gathered = True

    def _train_as_shard(self, slot: ShardedParam) -> None:
        """The whole parameter trains if its shard does (`requires_grad_` may have changed since fully_shard)."""
        slot.full.requires_grad_(slot.shard.requires_grad)
        if slot.full.requires_grad and id(slot.full) not in self._hooked:
            slot.full.register_post_accumulate_grad_hook(self._gradient_arrived)
            self._hooked.add(id(slot.full))

    def _gradient_arrived(self, param: torch.Tensor) -> None:
        if self._awaiting is None:
            self._awaiting = {id(slot.full) for slot in self.params if slot.full.requires_grad}
        self._awaiting.discard(id(param))
        if not self._awaiting:
            self.gradients_ready()

    def drop_gather(self) -> None:
        """Wait for a gather started but not used (a prefetch for a module that did not run) and drop it."""
        if self._gathering is not None:
            self._gathering[0].wait()
            self._gathering = None

    def reshard(self) -> None:
        """Free the whole parameters; the module shows its shards again."""
        if not self.gathered:
            return
        for slot in self.params:
            slot.register(slot.shard)
            slot.full.grad = None
            _free(slot.full)
        self.gathered = False

    def full_tensors(self) -> list[torch.Tensor]:
        """The whole parameters as new tensors, gathered now (a collective: every rank of the group calls it)."""
        _, everyone = self._gather(async_op=False)
        fulls = [torch.empty(slot.full.shape, dtype=self.dtype, device=self.device) for slot in self.params]
        self._copy_out(everyone, fulls)
        return fulls

    def _bound(self) -> ProcessGroup:
        if self.group is None:
            raise RuntimeError("fully_shard: this model was sharded with no process group to shard over (none was "
                               "initialized); shoal.elastic.LiveTraining gives it each generation's group once it is "
                               "constructed (or call init_process_group before fully_shard)")
        return self.group

    def _gather(self, async_op: bool) -> tuple[Work, torch.Tensor]:
        """All-gather every rank's part of the flat buffer (this rank's: its shards, padded)."""
        part = torch.zeros(self.part_numel, dtype=self.dtype, device=self.device)
        for slot in self.params:
            part[slot.flat(self.rank)].copy_(slot.shard.detach().reshape(-1))
        everyone = torch.empty(self.world * self.part_numel, dtype=self.dtype, device=self.device)
        return self._bound().all_gather_into_tensor(everyone, part, async_op=async_op), everyone

    def _copy_out(self, everyone: torch.Tensor, fulls: list[torch.Tensor]) -> None:
        by_rank = everyone.view(self.world, self.part_numel)
        for slot, full in zip(self.params, fulls, strict=True):
            for rank in range(self.world):
                full[slot.block(rank)].view(-1).copy_(by_rank[rank, slot.flat(rank)])

    # --- gradients ------------------------------------------------------------------------------------------

    def start_reduce(self) -> None:
        """Start reduce-scattering the gradients the whole parameters hold, and let them go. The parameters
        that have one are the same on every rank (each runs the same graph)."""
        with_grad = [slot for slot in self.params if slot.full.grad is not None]
        if not with_grad:
            return
        assert self._reducing is None, "a group's gradients are reduced once per backward"
        everyone = torch.zeros(self.world, self.part_numel, dtype=self.dtype, device=self.device)
        for slot in with_grad:
            grad = slot.full.grad
            for rank in range(self.world):
                everyone[rank, slot.flat(rank)].copy_(grad[slot.block(rank)].reshape(-1))
            slot.full.grad = None
        mine = torch.empty(self.part_numel, dtype=self.dtype, device=self.device)
        work = self._bound().reduce_scatter_tensor(mine, everyone.view(-1), ReduceOp.AVG, async_op=True)
        self._reducing = (work, mine, with_grad)
        self.started(("reduce", with_grad))

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter; each shard's `.grad` gets (or adds) the mean of its rows."""
        if self._reducing is None:
            return
        work, mine, with_grad = self._reducing
        work.wait()
        self._reducing = None
        self._add_grads(mine, with_grad)

    def drop_reduce(self) -> None:
        """Wait for a reduce-scatter of an abandoned backward and drop its result."""
        if self._reducing is not None:
            self._reducing[0].wait()
            self._reducing = None

    def _add_grads(self, mine: torch.Tensor, with_grad: list[ShardedParam]) -> None:
        for slot in with_grad:
            grad = mine[slot.flat(self.rank)].view(slot.shard.shape)
            if slot.shard.grad is None:
                slot.shard.grad = grad
            else:
                slot.shard.grad += grad

    # --- a joined rank's part in the live ranks' collectives ---------------------------------------------

    def shadow_gather(self) -> None:
        """Give this rank's rows to a gather the live ranks make; what comes back is not needed here."""
        self._gather(async_op=False)

    def shadow_reduce(self, with_grad: list[ShardedParam]) -> None:
        """Give zeros to a reduce-scatter the live ranks make; this rank's shards get their rows' mean."""
        mine = torch.empty(self.part_numel, dtype=self.dtype, device=self.device)
        everyone = torch.zeros(self.world * self.part_numel, dtype=self.dtype, device=self.device)
        self._bound().reduce_scatter_tensor(mine, everyone, ReduceOp.AVG, async_op=False)
        self._add_grads(mine, with_grad)

    def end_backward(self) -> None:
        """Forget which gradients arrived: a parameter this backward did not reach may be reached by the next."""
        self._awaiting = None
