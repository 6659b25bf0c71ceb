"""split_sequential: cut an nn.Sequential into contiguous stages, balanced by parameter count or by
given layer counts, one stage per rank of a pipeline."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn


def split_sequential(model: nn.Sequential, num_stages: int, *, balance: list[int] | None = None) -> list[nn.Sequential]:
    """Cut `model` into `num_stages` non-empty runs of consecutive layers.

    With `balance`, stage i gets the next `balance[i]` layers. Without it, the cut minimises the
    parameter count of the largest stage (ties put a parameter-free layer, such as an activation, with
    the layer before it). The stages hold the model's own layers, under their original names, so a
    stage's state_dict keys are the unsplit model's.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split_sequential: model must be an nn.Sequential, got {type(model).__name__}")
    layers = list(model.named_children())
    if num_stages < 1:
        raise ValueError(f"split_sequential: num_stages must be at least 1, got {num_stages}")
    if num_stages > len(layers):
        raise ValueError(f"split_sequential: cannot cut {len(layers)} layers into {num_stages} non-empty stages")
    if balance is None:
        balance = _balanced([sum(p.numel() for p in layer.parameters()) for _, layer in layers], num_stages)
    elif len(balance) != num_stages or any(count < 1 for count in balance) or sum(balance) != len(layers):
        raise ValueError(f"split_sequential: balance={list(balance)} must hold {num_stages} positive layer counts "
                         f"(one per stage) summing to the model's {len(layers)} layers (it sums to {sum(balance)})")
    stages, start = [], 0
    for count in balance:
        stages.append(nn.Sequential(OrderedDict(layers[start:start + count])))
        start += count
    return stages


def _balanced(weights: list[int], parts: int) -> list[int]:
    """Layer counts of the contiguous split of `weights` into `parts` non-empty runs whose largest sum
    is smallest (dynamic programming over split points; models have tens of layers, not thousands)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[k][e]: the smallest possible largest sum when the first e layers form k runs; cut[k][e]: where
    # the last of those runs starts.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for end in range(k, n - (parts - k) + 1):
            for start in range(k - 1, end):
                cost = max(best[k - 1][start], prefix[end] - prefix[start])
                if cost <= best[k][end]:  # on a tie the later start wins: the run before keeps trailing layers
                    best[k][end], cut[k][end] = cost, start
    counts, end = [], n
    for k in range(parts, 0, -1):
        counts.append(end - cut[k][end])
        end = cut[k][end]
    return counts[::-1]
