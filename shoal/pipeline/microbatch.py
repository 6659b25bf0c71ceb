"""Cutting a step's arguments into micro-batches and merging the last stage's outputs back, by the rules of
torch.distributed.pipelining.microbatch: a tensor is cut along its chunk spec's dim (dim 0 unless told),
anything else is given whole to every micro-batch; outputs are concatenated along dim 0 unless told.

Specs are duck-typed, so torch's own `TensorChunkSpec`, `_Replicate` and `_CustomReducer` objects work
beside ours (importing torch's module costs over a second).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten


class TensorChunkSpec:
    """Cut this argument (or merge this output) along `split_dim`."""

    def __init__(self, split_dim: int) -> None:
        self.split_dim = split_dim

    def __repr__(self) -> str:
        return f"TensorChunkSpec({self.split_dim})"

    @staticmethod
    def from_tuple(chunk_dims: tuple[int, ...]) -> tuple[TensorChunkSpec, ...]:
        return tuple(TensorChunkSpec(dim) for dim in chunk_dims)

    @staticmethod
    def from_dict(chunk_dims: dict[str, int]) -> dict[str, TensorChunkSpec]:
        return {name: TensorChunkSpec(dim) for name, dim in chunk_dims.items()}


class Replicate:
    """Give this argument whole to every micro-batch."""


def _replicates(spec: Any) -> bool:
    """None, or a replicate spec: ours or torch's `_Replicate`, the class itself or an instance."""
    name = spec.__name__ if isinstance(spec, type) else type(spec).__name__
    return spec is None or name in ("Replicate", "_Replicate")


def _reduces(spec: Any) -> bool:
    """torch's `_CustomReducer(init_value, reduce_fn)`: fold the micro-batches' values into one."""
    return hasattr(spec, "init_value") and hasattr(spec, "reduce_fn")


def _default_spec(value: Any) -> Any:
    return TensorChunkSpec(0) if isinstance(value, torch.Tensor) else Replicate()


def split_args_kwargs_into_chunks(args: tuple[Any, ...], kwargs: dict[str, Any] | None, chunks: int,
                                  args_chunk_spec: tuple[Any, ...] | None = None,
                                  kwargs_chunk_spec: dict[str, Any] | None = None) -> tuple[list[tuple], list[dict]]:
    """`chunks` micro-batches of (args, kwargs), nested containers included: micro-batch j gets the j-th
    `torch.tensor_split` piece of every tensor that is cut, and every other value whole."""
    kwargs = kwargs or {}
    args_chunk_spec = tree_map(_default_spec, args) if args_chunk_spec is None else tuple(args_chunk_spec)
    kwargs_chunk_spec = tree_map(_default_spec, kwargs) if kwargs_chunk_spec is None else kwargs_chunk_spec
    if len(args_chunk_spec) != len(args):
        raise ValueError(f"args_chunk_spec has {len(args_chunk_spec)} entries for {len(args)} positional arguments")
    if set(kwargs_chunk_spec) != set(kwargs):
        raise ValueError(f"kwargs_chunk_spec names {sorted(kwargs_chunk_spec)} but the keyword arguments are "
                         f"{sorted(kwargs)}")
    arg_pieces = _split(list(args), list(args_chunk_spec), chunks)
    kwarg_pieces = _split(kwargs, {name: kwargs_chunk_spec[name] for name in kwargs}, chunks)
    return [tuple(piece) for piece in arg_pieces], kwarg_pieces


def _split(values: Any, specs: Any, chunks: int) -> list[Any]:
    flat, structure = tree_flatten(values)
    flat_specs = tree_flatten(specs, is_leaf=lambda s: s is None or hasattr(s, "split_dim") or _replicates(s))[0]
    if len(flat_specs) != len(flat):
        raise ValueError(f"a chunk spec has {len(flat_specs)} entries for {len(flat)} values")
    pieces: list[list[Any]] = [[] for _ in range(chunks)]
    for value, spec in zip(flat, flat_specs, strict=True):
        if _replicates(spec) or not isinstance(value, torch.Tensor):
            if hasattr(spec, "split_dim") and not isinstance(value, torch.Tensor):
                raise ValueError(f"a chunk spec cuts along dim {spec.split_dim} a value that is not a tensor: "
                                 f"{type(value).__name__}")
            cut = [value] * chunks
        else:
            size = value.size(spec.split_dim)
            if size < chunks:
                raise ValueError(f"cannot cut a tensor of shape {tuple(value.shape)} along dim {spec.split_dim} "
                                 f"into {chunks} micro-batches: every micro-batch needs at least one row")
            cut = torch.tensor_split(value, chunks, spec.split_dim)
        for piece, part in zip(pieces, cut, strict=True):
            piece.append(part)
    return [tree_unflatten(piece, structure) for piece in pieces]


def merge_chunks(chunks: list[Any], chunk_spec: Any = None) -> Any:
    """One value from the micro-batches' values: tensors concatenated along their spec's dim (0 by default),
    values under a reducer folded, anything else taken from micro-batch 0."""
    flat_chunks = [tree_flatten(chunk)[0] for chunk in chunks]
    structure = tree_flatten(chunks[0])[1]
    if chunk_spec is None:
        specs = [TensorChunkSpec(0) if isinstance(v, torch.Tensor) else Replicate() for v in flat_chunks[0]]
    else:
        specs = tree_flatten(chunk_spec, is_leaf=lambda s: hasattr(s, "split_dim") or _reduces(s) or _replicates(s))[0]
    if any(len(flat) != len(specs) for flat in flat_chunks):
        raise ValueError(f"output_merge_spec has {len(specs)} entries but an output has "
                         f"{[len(flat) for flat in flat_chunks]} values")
    merged = []
    for k, spec in enumerate(specs):
        values = [flat[k] for flat in flat_chunks]
        if _reduces(spec):
            total = spec.init_value
            for value in values:
                total = spec.reduce_fn(total, value)
            merged.append(total)
        elif hasattr(spec, "split_dim") and isinstance(values[0], torch.Tensor):
            merged.append(torch.cat(values, dim=spec.split_dim))
        else:
            merged.append(values[0])
    return tree_unflatten(merged, structure)
