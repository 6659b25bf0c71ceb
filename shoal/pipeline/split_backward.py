"""Backward in two halves, for zero-bubble schedules: the gradients of a stage's inputs first (the previous
stage is waiting for them), the gradients of its weights later (whenever the rank would otherwise idle).

The input half runs autograd from the stage's outputs to its inputs only. On the way it passes every
"branch node": a node on the path to the inputs with an edge off that path towards a weight. A hook
records the gradient each branch node receives. The weight half then starts autograd at the branch
nodes (and at the outputs off the path, with the gradients they were given), with those gradients, and
runs it to the weights, so the path to the inputs is not run again, except a stretch between two branch
nodes of one group (a layer used twice, another between), which autograd passes through. A branch node
that another branch node feeds gets its recorded gradient, not a second copy of what flows in, so
nothing is counted twice. Weights are grouped by the branch nodes they hang off, and each group is one
autograd call (torch's stage_backward_input and stage_backward_weight work the same way).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def backward_input(roots: list[torch.Tensor], grads: list[torch.Tensor | None], inputs: list[torch.Tensor],
                   weights: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], Callable[[], None]]:
    """The gradients of `inputs` (None where an input needs none), and a function that, called later,
    accumulates the gradients of `weights` into their `.grad` as `torch.autograd.backward` would."""
    if not roots:
        return [None] * len(inputs), lambda: None
    wanted = [x for x in inputs if x.requires_grad]
    graph = _children([get_gradient_edge(root).node for root in roots])
    parents = _parents(graph)
    on_path = _reaching(parents, {get_gradient_edge(x).node for x in wanted if get_gradient_edge(x).node in graph})
    given: dict[GradientEdge, torch.Tensor] = {}  # what each root off the path is given (it never runs now)
    for root, grad in zip(roots, grads, strict=True):
        edge = get_gradient_edge(root)
        if edge.node not in on_path:
            grad = grad if grad is not None else torch.ones_like(root)
            given[edge] = given[edge] + grad if edge in given else grad  # a tensor returned twice: both
    groups = _weight_groups(parents, on_path, {edge.node for edge in given},
                            {get_gradient_edge(w).node: w for w in weights if w.requires_grad})
    received: dict[Node, tuple] = {}  # what each branch node on the path received, output by output
    hooks = [node.register_prehook(_recorder(received, node)) for node in set().union(*(g[0] for g in groups))
             if node in on_path]
    try:
        found = torch.autograd.grad(roots, wanted, grads, retain_graph=True, allow_unused=True) if wanted else ()
    finally:
        for hook in hooks:
            hook.remove()
    by_input = dict(zip(map(id, wanted), found, strict=True))
    return [by_input.get(id(x)) for x in inputs], lambda: _backward_weights(groups, received, given)


def _recorder(received: dict[Node, tuple], node: Node):
    def record(grad_outputs: tuple) -> None:
        received[node] = grad_outputs

    return record


def _children(roots: list[Node]) -> dict[Node, list[Node]]:
    graph: dict[Node, list[Node]] = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in graph:
            continue
        graph[node] = [child for child, _ in node.next_functions if child is not None]
        stack.extend(graph[node])
    return graph


def _parents(graph: dict[Node, list[Node]]) -> dict[Node, list[Node]]:
    parents: dict[Node, list[Node]] = {}
    for node, children in graph.items():
        for child in children:
            parents.setdefault(child, []).append(node)
    return parents


def _reaching(parents: dict[Node, list[Node]], targets: set[Node]) -> set[Node]:
    """The nodes from which a target is reachable (the targets included)."""
    found, stack = set(), list(targets)
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(parents.get(node, []))
    return found


def _weight_groups(parents: dict[Node, list[Node]], on_path: set[Node], given: set[Node],
                   weights: dict[Node, torch.Tensor]) -> list[tuple[set[Node], list[torch.Tensor]]]:
    """(branch nodes, weights) per group. A weight's gradient comes from the nodes found walking up from
    it, off the input path, to the path, and from the roots off the path met on the way (`given`: they
    are given a gradient, besides what may flow into them from other roots); weights that share such a
    node share a group."""
    sources: dict[Node, frozenset[Node]] = {}  # memo: where the gradient of an off-path node comes from
    groups: list[tuple[set[Node], list[torch.Tensor]]] = []
    for node, weight in weights.items():
        if node not in parents:
            continue  # unused by this micro-batch: no gradient, as in a full backward
        stack = [node]
        while stack:  # post-order over the parents, so each node's are known before its own
            current = stack[-1]
            pending = [up for up in parents.get(current, []) if up not in on_path and up not in sources]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            ups = parents.get(current, [])
            found = frozenset().union(*(frozenset({up}) if up in on_path else sources[up] for up in ups))
            sources[current] = found | {current} if current in given or not ups else found
        merged = [g for g in groups if g[0] & sources[node]]
        for g in merged:
            groups.remove(g)
        groups.append((set(sources[node]).union(*(g[0] for g in merged)), [w for g in merged for w in g[1]] + [weight]))
    return groups


def _backward_weights(groups: list[tuple[set[Node], list[torch.Tensor]]], received: dict[Node, tuple],
                      given: dict[GradientEdge, torch.Tensor]) -> None:
    for n, (sources, weights) in enumerate(groups):
        starts = {edge: grad for edge, grad in given.items() if edge.node in sources}
        for node in sources & received.keys():
            starts.update({GradientEdge(node, k): grad for k, grad in enumerate(received[node]) if grad is not None})
        if not starts:
            continue
        # A branch node fed by another gets exactly what it received in the input half.
        clamps = [node.register_prehook(lambda _, recorded=received[node]: recorded)
                  for node in sources & received.keys()] if len(sources) > 1 else []
        try:
            # A later group may pass through nodes this one runs (a layer used twice, another between).
            found = torch.autograd.grad(list(starts), weights, list(starts.values()), allow_unused=True,
                                        retain_graph=n < len(groups) - 1)
        finally:
            for clamp in clamps:
                clamp.remove()
        for weight, grad in zip(weights, found, strict=True):
            if grad is not None:
                if weight.grad is None:
                    weight.grad = grad
                else:
                    weight.grad += grad
