"""pipeline(): one model cut into stages at its marks, as torch.distributed.pipelining's frontend does, so
that a model need not be an nn.Sequential to run in a pipeline.

    pipe = pipeline(model, mb_args=(x_microbatch,), split_spec={"layers.4": SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, device)
    schedule = ScheduleGPipe(stage, n_microbatches, loss_fn=loss_fn)

The traced graph is cut at each `pipe_split` node. Stage k takes exactly what stage k-1 returns, in order:
a value made in stage a and used in stage b > a+1 is passed along by the stages between (as are the
model's own inputs), because a stage talks only to its neighbours. Parameters stay the model's own
objects, under their original names.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from shoal.pipeline.meta import check_sendable
from shoal.pipeline.stage import PipelineStage
from shoal.pipeline.tracing import SplitPoint, is_split, trace


@dataclass
class PipeInfo:
    """What building a stage needs to know of the whole pipe."""

    graph: fx.Graph
    num_stages: int
    has_loss_and_backward: bool


class Pipe(nn.Module):
    """A model cut into stages: `split_gm` calls its children `submod_0` ... `submod_{num_stages-1}` in turn,
    so calling the Pipe runs the whole model in one process."""

    def __init__(self, split_gm: fx.GraphModule, num_stages: int, has_loss_and_backward: bool, loss_spec) -> None:
        super().__init__()
        self.split_gm = split_gm
        self.num_stages = num_stages
        self.has_loss_and_backward = has_loss_and_backward
        self.loss_spec = loss_spec

    def forward(self, *args, **kwargs):
        return self.split_gm(*args, **kwargs)

    def get_stage_module(self, stage_idx: int) -> nn.Module:
        if not 0 <= stage_idx < self.num_stages:
            raise ValueError(f"Pipe: stage_idx={stage_idx}, but the pipe has stages 0 to {self.num_stages - 1}")
        return getattr(self.split_gm, f"submod_{stage_idx}")

    def info(self) -> PipeInfo:
        return PipeInfo(graph=self.split_gm.graph, num_stages=self.num_stages,
                        has_loss_and_backward=self.has_loss_and_backward)

    def build_stage(self, stage_index: int, device: torch.device, group=None) -> PipelineStage:
        return build_stage(self.get_stage_module(stage_index), stage_index, self.info(), device, group)


def build_stage(stage_module: nn.Module, stage_index: int, pipe_info: PipeInfo, device: torch.device,
                group=None) -> PipelineStage:
    """The PipelineStage that runs `stage_module`, stage `stage_index` of the pipe `pipe_info` describes."""
    return PipelineStage(stage_module, stage_index, pipe_info.num_stages, device, group=group)


def pipeline(module: nn.Module, mb_args: tuple[Any, ...], mb_kwargs: dict[str, Any] | None = None,
             split_spec: dict[str, SplitPoint] | None = None,
             split_policy: Callable[[fx.GraphModule], fx.GraphModule] | None = None) -> Pipe:
    """Cut `module` into stages at its `pipe_split()` calls, at the submodules `split_spec` names, or where
    `split_policy` (given the traced graph, returning it with split marks) puts marks. `mb_args` and
    `mb_kwargs` are one micro-batch's arguments: arguments they leave out keep their defaults. Unless the
    model is on the meta device, the stages then run that micro-batch once, so that a cut that would pass
    anything but tensors between stages is named now rather than at the first step."""
    if split_spec is not None and split_policy is not None:
        raise ValueError("pipeline: give split_spec or split_policy, not both")
    traced = trace(module, tuple(mb_args), mb_kwargs, split_spec)
    if split_policy is not None:
        traced = split_policy(traced)
    split_gm, num_stages = _split(traced)
    pipe = Pipe(split_gm, num_stages, has_loss_and_backward=False, loss_spec=None)
    if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        _check_cuts(pipe, module, tuple(mb_args), mb_kwargs or {})
    return pipe


def _split(traced: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """`split_gm`: the stages' graphs as children of one graph that calls them in turn."""
    nodes = [node for node in traced.graph.nodes if node.op != "get_attr"]
    stage_of: dict[fx.Node, int] = {}
    k = 0
    for node in nodes:
        if is_split(node):
            k += 1
        elif node.op != "output":
            stage_of[node] = k
    last = k
    output = next(node for node in nodes if node.op == "output")
    empty = set(range(last + 1)) - {s for node, s in stage_of.items() if node.op != "placeholder"}
    if empty:
        raise ValueError(f"pipeline: stage {min(empty)} would compute nothing; put at least one operation between "
                         f"two split points, and none at the very start or end of forward")
    crossing: list[list[fx.Node]] = [[] for _ in range(last)]  # what stage k hands stage k+1
    for node, made in stage_of.items():
        used = [last if user.op == "output" else stage_of[user] for user in node.users if not is_split(user)]
        for boundary in range(made, max(used, default=made)):
            crossing[boundary].append(node)
    placeholders = [node for node in nodes if node.op == "placeholder"]
    root = nn.Module()
    for k in range(last + 1):
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}

        def look_up(node: fx.Node, graph=graph, env=env) -> fx.Node:
            if node not in env:  # a parameter or buffer: each stage reads its own
                env[node] = graph.get_attr(node.target)
            return env[node]

        if k == 0:
            for node in placeholders:
                env[node] = graph.node_copy(node)
        else:
            for node in crossing[k - 1]:
                env[node] = graph.placeholder(node.name)
        for node in nodes:
            if stage_of.get(node) == k and node.op != "placeholder":
                env[node] = graph.node_copy(node, look_up)
        graph.output(fx.node.map_arg(output.args[0], look_up) if k == last
                     else tuple(look_up(node) for node in crossing[k]))
        root.add_module(f"submod_{k}", fx.GraphModule(traced, graph, f"Stage{k}"))
    top = fx.Graph()
    values: list[fx.Node] = [top.node_copy(node) for node in placeholders]
    for k in range(last + 1):
        result = top.call_module(f"submod_{k}", tuple(values))
        if k < last:
            values = [top.call_function(operator.getitem, (result, i)) for i in range(len(crossing[k]))]
    top.output(result)
    return fx.GraphModule(root, top, "SplitModel"), last + 1


def _check_cuts(pipe: Pipe, module: nn.Module, mb_args: tuple, mb_kwargs: dict) -> None:
    """Run one micro-batch through the stages in turn; raise if a cut passes what cannot travel between
    stages (anything but tensors, too many, too many dims). The model is left as it was: its buffers
    (a BatchNorm's running statistics) and the random generators' states are put back."""
    buffers = [(buffer, buffer.clone()) for buffer in module.buffers()]
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            values = pipe.get_stage_module(0)(*mb_args, **mb_kwargs)
            for k in range(1, pipe.num_stages):
                bad = [f"{type(v).__name__} {v!r}"[:80] for v in values if not isinstance(v, torch.Tensor)]
                if bad:
                    raise TypeError(f"pipeline: stage {k - 1} would pass stage {k} {', '.join(bad)}; only tensors "
                                    f"travel between stages: move the split point so that such values are made "
                                    f"where they are used")
                check_sendable(tuple(values), k - 1)
                values = pipe.get_stage_module(k)(*values)
        finally:
            for buffer, saved in buffers:
                buffer.copy_(saved)
