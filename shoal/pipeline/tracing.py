"""Marking where a model splits into stages, and tracing it into one graph with the marks in it.

`pipe_split()` in a forward, or a `SplitPoint` for a submodule in `split_spec`, marks a cut. The model is
traced with torch.fx's symbolic tracer, which records each mark as a node wherever the call was made
from (the tracer currently running is found through a context variable, so a mark needs no import
trick). Arguments the example micro-batch does not give keep their defaults, baked into the graph, as
torch's exporter does, and the traced forward no longer takes them.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Iterator
from enum import Enum
from typing import Any

from torch import fx, nn

_tracer: contextvars.ContextVar[fx.Tracer | None] = contextvars.ContextVar("shoal_pipeline_tracer", default=None)


def pipe_split() -> None:
    """Cut the model here: what runs after this call belongs to the next stage. Does nothing when the
    model simply runs."""
    tracer = _tracer.get()
    if tracer is not None:
        tracer.create_proxy("call_function", pipe_split, (), {})


def is_split(node: fx.Node) -> bool:
    """Whether `node` marks a cut: ours, or torch's own marker op from a split_policy written for torch."""
    return node.op == "call_function" and (node.target is pipe_split or "_pipe_split" in str(node.target))


class SplitPoint(Enum):
    """Where a submodule named in `split_spec` cuts the model: before it runs, or after."""

    BEGINNING = 1
    END = 2


class _Tracer(fx.Tracer):
    """Traces into the submodules that carry a split point, so that their marks are recorded."""

    def __init__(self, marked: set[str]) -> None:
        super().__init__()
        self.marked = marked

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name not in self.marked and super().is_leaf_module(m, module_qualified_name)


def trace(module: nn.Module, mb_args: tuple[Any, ...], mb_kwargs: dict[str, Any] | None,
          split_spec: dict[str, SplitPoint] | None) -> fx.GraphModule:
    """`module`'s forward as a graph, with a `pipe_split` node at every mark, taking the arguments the
    example micro-batch gives (the others keep their defaults, baked in)."""
    name = type(module).__name__
    parameters = list(inspect.signature(module.forward).parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        raise TypeError(f"pipeline: {name}.forward takes *args or **kwargs; tracing needs named arguments")
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(mb_args) > len(positional):
        raise TypeError(f"pipeline: mb_args has {len(mb_args)} values but {name}.forward takes {len(positional)} "
                        f"positional arguments")
    given = set(mb_kwargs or {}) | {p.name for p in positional[:len(mb_args)]}
    missing = [p.name for p in parameters if p.name not in given and p.default is p.empty]
    if missing:
        raise TypeError(f"pipeline: {name}.forward needs {missing}: give them in mb_args or mb_kwargs")
    baked = {p.name: p.default for p in parameters if p.name not in given}
    tracer = _Tracer(set(split_spec or {}))
    token = _tracer.set(tracer)
    try:
        with _marked(module, split_spec or {}):
            graph = tracer.trace(module, concrete_args=baked or None)
    finally:
        _tracer.reset(token)
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    for parameter, node in zip(parameters, placeholders, strict=True):
        if parameter.name in baked:
            _drop(graph, node)
    return fx.GraphModule(module, graph, name)


def _drop(graph: fx.Graph, placeholder: fx.Node) -> None:
    """Remove the placeholder of a baked argument and the guards the tracer hung on it (that the value
    is still the default), so that the traced forward no longer takes the argument at all."""
    closure, stack = [], [placeholder]
    while stack:
        node = stack.pop()
        if node not in closure:
            closure.append(node)
            stack.extend(node.users)
    if any(node.op != "call_function" for node in closure[1:]):
        return  # not only guards: keep it (the argument stays, with its default)
    for node in sorted(closure, key=list(graph.nodes).index, reverse=True):
        graph.erase_node(node)


@contextlib.contextmanager
def _marked(module: nn.Module, split_spec: dict[str, SplitPoint]) -> Iterator[None]:
    """Have each submodule in `split_spec` call pipe_split before or after its forward, while tracing."""
    patched = []
    try:
        for qualname, point in split_spec.items():
            try:
                submodule = module.get_submodule(qualname)
            except AttributeError as exc:
                raise AttributeError(f"pipeline: split_spec names {qualname!r}, which {type(module).__name__} does "
                                     f"not have: {exc}") from exc
            if getattr(point, "name", None) not in ("BEGINNING", "END"):  # ours, or torch's SplitPoint
                raise ValueError(f"pipeline: split_spec[{qualname!r}] must be SplitPoint.BEGINNING or .END, "
                                 f"got {point!r}")
            patched.append((submodule, submodule.__dict__.get("forward")))
            submodule.forward = _with_split(submodule.forward, point)
        yield
    finally:
        for submodule, own in reversed(patched):
            if own is None:
                del submodule.forward  # the class's forward shows through again
            else:
                submodule.forward = own


def _with_split(forward, point: SplitPoint):
    def split_forward(*args, **kwargs):
        if point.name == "BEGINNING":
            pipe_split()
        output = forward(*args, **kwargs)
        if point.name == "END":
            pipe_split()
        return output

    return split_forward
