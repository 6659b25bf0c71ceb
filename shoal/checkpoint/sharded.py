"""Sharded checkpoints of a fully_shard model and its optimizer: each rank writes only its rows, and a job of
any size reads them back, each rank taking its rows from the files that hold them.

    checkpoints = ShardedCheckpoint("ckpt", keep=3)
    checkpoints.save(step, model, optimizer, extra={"rng": capture_rng()})   # every rank, its own file
    latest = checkpoints.load_latest(model, optimizer)    # every rank; None, or the step and extra

Each rank's file holds its rows of every sharded parameter and of every optimizer state tensor shaped like
one (Adam's moments, momentum), with where those rows lie in the whole, and the rest whole (unsharded
parameters, buffers, the optimizer's step counts and group settings). Optimizer state is kept by parameter
name, not position. Files are written as CheckpointManager writes them (atomic, verified, the newest `keep`
kept, one manifest per rank); a step counts only if every rank that saved it has a file that verifies, so a
job stopped mid-save loads the step before. Each loading rank verifies every file of the step (reading it
whole for its SHA-256), then maps them and copies out its rows.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shoal.checkpoint.manager import Checkpoint, CheckpointManager, _warn_skipped
from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.api.world import default_group
from shoal.comm.backends.group import ProcessGroup
from shoal.parallel.fully_shard import FSDPModule
from shoal.parallel.shard_group import ShardedParam

__all__ = ["ShardedCheckpoint"]

_FORMAT = 1


def _sharded(model: nn.Module) -> dict[str, ShardedParam]:
    """The model's sharded parameters by their names in `model.named_parameters()`."""
    found = {}
    for prefix, module in model.named_modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # between steps the shards are the parameters; make sure
            for slot in module._shoal_shards.group.params:
                found[f"{prefix}.{slot.path}" if prefix else slot.path] = slot
    return found


class ShardedCheckpoint:
    """Saves a fully_shard model and its optimizer rank by rank, and loads them onto any number of ranks."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, group: ProcessGroup | None = None) -> None:
        self.group = group if group is not None else default_group()
        self.directory = Path(directory)
        self._manager = CheckpointManager(directory, keep=keep, rank=self.group.rank)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
             extra: Any = None) -> None:
        """Write this rank's part of `step` (every rank calls it; no collective)."""
        sharded = _sharded(model)
        rows, whole = {}, {}
        for name, param in model.named_parameters():
            slot = sharded.get(name)
            if slot is None:
                whole[name] = param.detach()
            else:
                block = slot.block(self.group.rank)
                rows[name] = (param.detach(), block.start, block.stop, tuple(slot.full.shape))
        state = {"format": _FORMAT, "world": self.group.size, "rows": rows, "whole": whole,
                 "buffers": dict(model.named_buffers()), "extra": extra,
                 "optimizer": None if optimizer is None else _optimizer_by_name(model, optimizer, sharded)}
        self._manager.save(step, state, per_rank=True)

    def load_latest(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Checkpoint | None:
        """Restore the newest step every saving rank's file holds and verifies, resharded onto this job's
        ranks (every rank calls it together: they agree on the step, even where one of them cannot read a
        file another can). Returns None, or the step and `extra` in `.state`."""
        steps = sorted(self._manager.per_rank_steps(), reverse=True)
        below = None  # the agreed step must be older than this
        while True:
            mine, parts = -1, None  # this rank's newest step below `below` whose files all verify here
            for step in steps:
                if below is None or step < below:
                    parts = self._readable(step)
                    if parts is not None:
                        mine = step
                        break
            agreed = self._least(mine)
            if agreed < 0:
                return None
            if agreed != mine:
                parts = self._readable(agreed)
            if self._least(0 if parts is None else 1) == 1:
                _restore(parts, model, optimizer, self.group.rank)
                return Checkpoint(agreed, {"extra": parts[0]["extra"]}, self.directory)
            below = agreed

    def _readable(self, step: int) -> list[dict] | None:
        """`_parts`, or None where a file cannot be read here: every other rank then looks further, so none is
        left waiting in the agreement for one that raised."""
        try:
            return self._parts(step)
        except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as exc:
            _warn_skipped(self.directory / f"step {step}", f"unreadable here ({type(exc).__name__}: {exc})")
            return None

    def _least(self, value: int) -> int:
        """The least of every rank's `value`."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.group.device)
        self.group.all_reduce(tensor, ReduceOp.MIN).wait()
        return int(tensor.item())

    def _parts(self, step: int) -> list[dict] | None:
        """Every saving rank's file of `step`, mapped, or None if one is missing or does not verify."""
        first = self._manager.verified_file(step, rank=0)
        if first is None:
            return None
        parts = [torch.load(first, weights_only=True, mmap=True)]
        if parts[0].get("format") != _FORMAT:
            raise ValueError(f"{first} is not a ShardedCheckpoint of format {_FORMAT} (it holds "
                             f"{parts[0].get('format')!r})")
        for rank in range(1, parts[0]["world"]):
            path = self._manager.verified_file(step, rank=rank)
            if path is None:
                return None
            parts.append(torch.load(path, weights_only=True, mmap=True))
        return parts


def _optimizer_by_name(model: nn.Module, optimizer: torch.optim.Optimizer,
                       sharded: dict[str, ShardedParam]) -> dict[str, dict]:
    """Each parameter's optimizer state and group settings under its name; state tensors shaped like a sharded
    parameter are its rows, the rest (step counts) whole."""
    names = {id(param): name for name, param in model.named_parameters()}
    saved = optimizer.state_dict()
    by_name = {}
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        settings = {key: value for key, value in saved_group.items() if key != "params"}
        for param, index in zip(group["params"], saved_group["params"], strict=True):
            if id(param) not in names:
                raise ValueError(f"the optimizer steps a parameter of shape {tuple(param.shape)} that is not the "
                                 f"model's: build it from model.parameters() after fully_shard")
            name = names[id(param)]
            state = saved["state"].get(index, {})
            rows = {key: value for key, value in state.items()
                    if name in sharded and torch.is_tensor(value) and value.shape == param.shape}
            by_name[name] = {"rows": rows, "whole": {key: value for key, value in state.items() if key not in rows},
                             "group": settings}
    return by_name


def _rows(parts: list[dict], start: int, stop: int, read: Any) -> torch.Tensor:
    """Rows [start, stop) of a whole tensor saved as rows across `parts`; `read(part)` gives a part's rows
    and where they lie (tensor, start, stop)."""
    pieces = []
    for part in parts:
        tensor, lo, hi = read(part)
        a, b = max(start, lo), min(stop, hi)
        if a < b:
            pieces.append(tensor[a - lo:b - lo])
    if not pieces:  # this rank holds no rows of it
        tensor = read(parts[0])[0]
        return tensor.new_empty((0, *tensor.shape[1:]))
    return torch.cat(pieces)


def _value(parts: list[dict], name: str, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of parameter `name`, from wherever it was saved (as rows, or whole)."""
    if name in parts[0]["whole"]:
        return parts[0]["whole"][name][start:stop]
    if name not in parts[0]["rows"]:
        raise ValueError(f"the checkpoint holds no parameter {name!r}; it holds {sorted(parts[0]['rows'])} "
                         f"sharded and {sorted(parts[0]['whole'])} whole")
    return _rows(parts, start, stop, lambda part: part["rows"][name][:3])


def _restore(parts: list[dict], model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int) -> None:
    sharded = _sharded(model)
    spans = {}
    for name, param in model.named_parameters():
        slot = sharded.get(name)
        block = slot.block(rank) if slot is not None else slice(0, param.shape[0] if param.dim() else None)
        spans[name] = block
        value = _value(parts, name, block.start, block.stop) if param.dim() else parts[0]["whole"][name]
        if value.shape != param.shape:
            raise ValueError(f"parameter {name!r}: the checkpoint gives shape {tuple(value.shape)} for this rank, "
                             f"the model has {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(value)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(parts[0]["buffers"][name])
    if optimizer is not None:
        optimizer.load_state_dict(_optimizer_state(parts, model, optimizer, spans))


def _own(value: Any) -> Any:
    """A tensor of its own, not a view of the mapped file (which a later save may delete)."""
    return value.clone() if torch.is_tensor(value) else value


def _shaped_like(value: Any, param: torch.Tensor | None) -> bool:
    return param is not None and param.dim() > 0 and torch.is_tensor(value) and value.shape == param.shape


def _optimizer_state(parts: list[dict], model: nn.Module, optimizer: torch.optim.Optimizer,
                     spans: dict[str, slice]) -> dict:
    """The optimizer's state dict for this rank's rows, by position again."""
    names = {id(param): name for name, param in model.named_parameters()}
    saved = parts[0]["optimizer"]
    if saved is None:
        raise ValueError("the checkpoint holds no optimizer state (it was saved without an optimizer)")
    state, groups, index = {}, [], 0
    for group in optimizer.param_groups:
        settings = None
        for param in group["params"]:
            name = names[id(param)]
            if name not in saved:
                raise ValueError(f"the checkpoint holds no optimizer state for parameter {name!r}")
            entry, span = saved[name], spans[name]
            settings = entry["group"]
            saved_whole = parts[0]["whole"].get(name)
            state[index] = {key: _own(value[span] if _shaped_like(value, saved_whole) else value)
                            for key, value in entry["whole"].items()}  # a parameter saved whole: its rows here
            for key in entry["rows"]:
                state[index][key] = _rows(parts, span.start, span.stop,
                                          lambda part, n=name, k=key: (part["optimizer"][n]["rows"][k],
                                                                       *part["rows"][n][1:3]))
            index += 1
        groups.append({**(settings or {}), "params": list(range(index - len(group["params"]), index))})
    return {"state": state, "param_groups": groups}
