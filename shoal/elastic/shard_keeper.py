"""Sharded training state under live recovery: each worker's block of a fully_shard model (its rows of every
parameter and of the optimizer state shaped like them) is also held by `redundancy` buddies, the next ranks
round the ring, so that a lost worker's rows outlive it.

A buddy keeps its copies current with no state on the wire: before a step's decision each worker sends its
buddies its reduced gradient rows, and when the step commits each buddy steps its copies with an optimizer of
the same kind and settings, as the worker steps its own (the same arithmetic on the same values). A change of
generation re-shards: each block of the last committed layout is broadcast from one member that holds it, and
every member keeps the rows of its new block and of its buddies' (a joiner receives its rows the same way).
The last committed layout's rows are kept until the new generation's first committed step, so a loss while
re-sharding starts again from them.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shoal.comm.backends.group import ProcessGroup
from shoal.comm.objects import broadcast_object_list
from shoal.parallel.fully_shard import FSDPModule
from shoal.parallel.shard_group import ShardedParam, block_rows

ROWS = "rows"  # in the layout's key list: a state value with one row per parameter row, re-cut with them
Block = list[dict[str, torch.Tensor]]  # per parameter: "param" and its optimizer state, for one block's rows


@dataclass
class _Holdings:
    """The blocks of one layout (its members, by rank) that this worker holds."""

    members: tuple[str, ...]
    blocks: dict[int, Block]


def _rows(total: int, world: int, block: int) -> slice:
    """The rows of a `total`-row parameter that `block` of `world` holds, as fully_shard cuts them."""
    return block_rows(total, math.ceil(total / world), block)


def settings(group: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's parameter group less its parameters: the learning rate and the rest."""
    return {key: value for key, value in group.items() if key != "params"}


@dataclass
class _Buddy:
    """Copies of one other worker's block, stepped as it steps its own."""

    block: int
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer


class ShardKeeper:
    """Keeps a fully_shard model's state through changes of generation (shoal.elastic.LiveTraining)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, redundancy: int) -> None:
        if redundancy < 1:
            raise ValueError(f"redundancy must be at least 1 (each block held by one other worker), got {redundancy}")
        self.shardings = [m._shoal_shards for m in model.modules() if isinstance(m, FSDPModule)]
        if any(sharding.group.group is not None for sharding in self.shardings):
            raise ValueError("LiveTraining shards the model over each generation's group: call fully_shard with no "
                             "group and no process group initialized (the script under `shoal run --live`)")
        self.slots: list[ShardedParam] = [slot for s in self.shardings for slot in s.group.params]
        self.optimizer, self.redundancy = optimizer, redundancy
        sharded = {id(slot.shard) for slot in self.slots}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in sharded:
                    raise ValueError(f"live recovery of a fully_shard model: the optimizer steps a parameter of "
                                     f"shape {tuple(param.shape)} that fully_shard did not shard; every parameter "
                                     f"it steps must be sharded (not in ignored_params)")
        dtypes = {slot.shard.dtype for slot in self.slots}
        if len(dtypes) > 1:
            raise ValueError(f"live recovery of a fully_shard model moves its rows as one dtype; the model's "
                             f"parameters have {sorted(map(str, dtypes))}")
        self._group_of = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self._members: tuple[str, ...] | None = None  # the current layout's (None: the whole model, uncut)
        self._block = 0  # this worker's block in the current layout
        self._buddies: list[_Buddy] = []
        self._held: _Holdings | None = None  # the last committed layout's, while the current one is not
        self._state_checked = False  # the optimizer's state can be cut with the rows (known after a first step)

    @classmethod
    def of(cls, model: nn.Module, optimizer: torch.optim.Optimizer, redundancy: int) -> ShardKeeper:
        """The keeper an earlier training of `model` in this script left (the model is cut as it says), or a
        new one for a model not yet cut."""
        kept = getattr(model, "_shoal_keeper", None)
        if kept is None:
            kept = model._shoal_keeper = cls(model, optimizer, redundancy)
        elif kept.optimizer is not optimizer or kept.redundancy != redundancy:
            raise ValueError("this fully_shard model was trained under an earlier LiveTraining, which cut it over "
                             "its generations: a later training of it must use the same optimizer and redundancy")
        return kept

    # --- each step ----------------------------------------------------------------------------------------

    def send_gradients(self, group: ProcessGroup) -> None:
        """Give each buddy this worker's reduced gradient rows, and take those of the workers this one is a
        buddy of, before the step's decision. One all-to-all (empty between ranks that are not buddies): a
        collective, so that a member lost anywhere fails it on every rank, where a receive from a live
        member that never sends (its backward failed) would wait out the timeout."""
        with_grad = [i for i, slot in enumerate(self.slots) if slot.shard.grad is not None]
        if not self._buddies or not with_grad:  # alike on every member: they run the same graph
            return
        mine = torch.cat([self.slots[i].shard.grad.reshape(-1) for i in with_grad])
        ins = [mine.new_empty(0) for _ in range(group.size)]
        outs = [mine.new_empty(0) for _ in range(group.size)]
        for distance, buddy in enumerate(self._buddies, start=1):
            ins[(group.rank + distance) % group.size] = mine
            outs[buddy.block] = mine.new_empty(sum(buddy.params[i].numel() for i in with_grad))
        group.all_to_all(outs, ins, async_op=False)
        for buddy in self._buddies:
            offset = 0
            for i in with_grad:
                param = buddy.params[i]
                param.grad = outs[buddy.block][offset:offset + param.numel()].view(param.shape)
                offset += param.numel()

    def commit(self) -> None:
        """The step committed: step the copies as their workers step their blocks, with the settings (the
        learning rate a schedule sets) the optimizer has now."""
        for buddy in self._buddies:
            for mine, theirs in zip(self.optimizer.param_groups, buddy.optimizer.param_groups, strict=True):
                theirs.update(settings(mine))
            buddy.optimizer.step()
        self._held = None  # the current layout is committed
        if not self._state_checked:  # alike on every member, so all raise together, at the first step
            self._state_checked = True
            if refusal := self._refusal([_state(slot.shard, self.optimizer) for slot in self.slots]):
                raise ValueError(refusal)

    def drop_gradients(self) -> None:
        """After each step, committed or discarded: the gradients the buddies received go with the workers' own."""
        for buddy in self._buddies:
            buddy.optimizer.zero_grad()

    # --- changes of generation --------------------------------------------------------------------------

    def reshard(self, group: ProcessGroup, members: Sequence[str], holds_state: bool) -> None:
        """Re-cut the model over `group`, whose ranks are `members`: this worker's new block and its buddies'
        from the blocks of the last committed layout, each broadcast by a member that holds it (the new
        rank 0 holds state: LiveTraining checks). A collective of the generation."""
        source = self._held or (self._holdings(members[group.rank]) if holds_state else None)
        plan: list[Any] = [None]
        if group.rank == 0:
            assert source is not None
            own = source.blocks[source.members.index(members[0])]
            plan = [self._refusal(own) or (source.members, [{key: ROWS if _is_rows(value, block["param"]) else value
                                                               for key, value in block.items()} for block in own])]
        broadcast_object_list(group, plan, group.ranks[0])
        if isinstance(plan[0], str):  # on every member, as none can go on
            raise ValueError(plan[0])
        old_members, keys = plan[0]
        copies = min(self.redundancy, group.size - 1)
        wanted = [(group.rank - distance) % group.size for distance in range(copies + 1)]
        new = {b: [{key: _cut(slot, group.size, b) if _is_marker(value) else _copy(value) for key, value in k.items()}
                   for slot, k in zip(self.slots, keys, strict=True)] for b in wanted}
        for old in range(len(old_members)):
            src = self._holder(old, old_members, members)
            flat = self._flat(source.blocks[old], keys) if src == group.rank else self._flat_empty(
                old, len(old_members), keys)
            if flat.numel():
                group.broadcast(flat, group.ranks[src], async_op=False)
            self._take(flat, old, len(old_members), keys, new, group.size)
        # Until a step commits in the new layout, the last committed one is the one to start again from (before
        # the first commit, the uncut model: the next generation's rank 0's, as the first cut took rank 0's).
        self._held = source
        self._install(group, members, new, wanted)

    def _refusal(self, own: Block) -> str | None:
        """Why the optimizer's state cannot be cut with the rows, if it cannot: a tensor neither one value
        per parameter (Adam's step) nor one row per row (a factored moment, as Adafactor keeps), or rows of
        another dtype than the parameters' (they travel as one buffer)."""
        for slot, block in zip(self.slots, own, strict=True):
            for key, value in block.items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    continue
                if not _is_rows(value, block["param"]):
                    return (f"live recovery of a fully_shard model: the optimizer's state {key!r} of {slot.path!r} "
                            f"has shape {tuple(value.shape)}, neither one row per row of the shard "
                            f"{tuple(block['param'].shape)} nor one value: it cannot be cut with the rows")
                if value.dtype != block["param"].dtype:
                    return (f"live recovery of a fully_shard model: the optimizer's state {key!r} of {slot.path!r} "
                            f"is {value.dtype}, the parameters {block['param'].dtype}: its rows travel with theirs")
        return None

    def _holder(self, block: int, old_members: tuple[str, ...], members: Sequence[str]) -> int:
        """The new rank of the first member of the old layout, round the ring from `block`'s own worker,
        that is still here to hold it."""
        copies = min(self.redundancy, len(old_members) - 1)
        for distance in range(copies + 1):
            member = old_members[(block + distance) % len(old_members)]
            if member in members:
                return list(members).index(member)
        holders = [old_members[(block + d) % len(old_members)] for d in range(copies + 1)]
        raise RuntimeError(f"block {block} of the sharded model was held by {holders} (redundancy="
                           f"{self.redundancy}), and all of them were lost before the layout after them was "
                           f"committed: its rows are gone. Restart the job from a checkpoint (the model's and the "
                           f"optimizer's state_dict, saved while it trained), or train with a larger redundancy")

    def _holdings(self, me: str) -> _Holdings:
        """The blocks this worker holds now, by reference: its own (the model's shards and their optimizer
        state) and its buddies' copies. Before the first cut, the whole model is its one block, a layout of
        one (the new rank 0's is the one taken)."""
        blocks = {self._block: [_state(slot.shard, self.optimizer) for slot in self.slots]}
        for buddy in self._buddies:
            blocks[buddy.block] = [_state(param, buddy.optimizer) for param in buddy.params]
        return _Holdings(self._members or (me,), blocks)

    def _flat(self, block: Block, keys: list[dict]) -> torch.Tensor:
        return torch.cat([block[i][key].reshape(-1) for i, key in _row_keys(keys)])

    def _flat_empty(self, old: int, world: int, keys: list[dict]) -> torch.Tensor:
        numel = 0
        for i, _ in _row_keys(keys):
            rows = _rows(self.slots[i].full.shape[0], world, old)
            numel += (rows.stop - rows.start) * self.slots[i].row_numel
        return torch.empty(numel, dtype=self.slots[0].shard.dtype, device=self.slots[0].shard.device)

    def _take(self, flat: torch.Tensor, old: int, old_world: int, keys: list[dict], new: dict[int, Block],
              world: int) -> None:
        """Copy the rows of old block `old` that fall in each wanted new block."""
        offset = 0
        for i, key in _row_keys(keys):
            slot = self.slots[i]
            have = _rows(slot.full.shape[0], old_world, old)
            rows = flat[offset:offset + (have.stop - have.start) * slot.row_numel].view(-1, *slot.full.shape[1:])
            offset += rows.numel()
            for b, block in new.items():
                want = _rows(slot.full.shape[0], world, b)
                lo, hi = max(have.start, want.start), min(have.stop, want.stop)
                if lo < hi:
                    block[i][key][lo - want.start:hi - want.start] = rows[lo - have.start:hi - have.start]

    def _install(self, group: ProcessGroup, members: Sequence[str], new: dict[int, Block], wanted: list[int]) -> None:
        """This worker's new block becomes the model's shards and their optimizer state; the others, its
        buddies' copies, each with an optimizer of the model's kind."""
        mine = new[group.rank]
        start = 0
        for sharding in self.shardings:  # each drops what it had in flight on the old group, unawaited
            count = len(sharding.group.params)
            sharding.group.recut(group, [state["param"] for state in mine[start:start + count]])
            start += count
        for tree in {id(s.tree): s.tree for s in self.shardings if s.tree is not None}.values():
            if tree.in_backward:
                tree.abandon_backward()  # a backward the loss broke: nothing of it is kept
        for slot, state in zip(self.slots, mine, strict=True):
            _set_state(self.optimizer, slot.shard, state)
        self._buddies = [self._buddy(block, new[block]) for block in wanted[1:]]
        self._members, self._block = tuple(members), group.rank

    def _buddy(self, block: int, state: Block) -> _Buddy:
        params = [nn.Parameter(s["param"], requires_grad=slot.shard.requires_grad)
                  for slot, s in zip(self.slots, state, strict=True)]
        groups = [{**settings(group), "params": []}
                  for group in self.optimizer.param_groups]
        for slot, param in zip(self.slots, params, strict=True):
            if id(slot.shard) in self._group_of:
                groups[self._group_of[id(slot.shard)]]["params"].append(param)
        optimizer = _like(self.optimizer, groups)
        for param, s in zip(params, state, strict=True):
            _set_state(optimizer, param, s)
        return _Buddy(block, params, optimizer)


def _like(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """An optimizer of `optimizer`'s class over `groups` (which carry every setting), new: no state, no hooks
    (a scheduler's wrapper of `step` is the original's). Its constructor gets the settings it takes, where
    `defaults` may hold more (AdamW's hold the decoupled_weight_decay of Adam, its base, which it sets itself)."""
    takes = inspect.signature(type(optimizer).__init__).parameters
    any_setting = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values())
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if any_setting or k in takes})


def _row_keys(keys: list[dict]) -> list[tuple[int, str]]:
    return [(i, key) for i, k in enumerate(keys) for key, value in k.items() if _is_marker(value)]


def _state(param: nn.Parameter, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {"param": param.data, **optimizer.state.get(param, {})}


def _set_state(optimizer: torch.optim.Optimizer, param: nn.Parameter, state: dict[str, torch.Tensor]) -> None:
    kept = {key: value for key, value in state.items() if key != "param"}
    if kept:
        optimizer.state[param] = kept
    else:
        optimizer.state.pop(param, None)


def _is_rows(value: object, param: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == param.shape


def _is_marker(value: object) -> bool:
    return isinstance(value, str) and value == ROWS


def _cut(slot: ShardedParam, world: int, block: int) -> torch.Tensor:
    """Room for `block`'s rows of the parameter (or of a state value shaped like it), filled by the re-cut."""
    rows = _rows(slot.full.shape[0], world, block)
    return torch.empty((rows.stop - rows.start, *slot.full.shape[1:]), dtype=slot.shard.dtype,
                       device=slot.shard.device)


def _copy(value: object) -> object:
    return value.clone() if torch.is_tensor(value) else value
