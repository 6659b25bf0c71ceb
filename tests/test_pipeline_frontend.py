"""pipeline(): a model that is not an nn.Sequential, cut at pipe_split() calls, at split_spec's submodules
or where a split_policy marks, into stages that compute the model (values a later stage needs passed
along), keep the model's parameter names, train across ranks as torch's own frontend does, and refuse
cuts that cannot work with errors that say why."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx, nn

from shoal.pipeline import Pipe, SplitPoint, pipe_split, pipeline
from tests.ranks import run_ranks

CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.relu(self.lin(self.norm(x)))
        return x + (y * mask if mask is not None else y)


class Net(nn.Module):
    """Four blocks; `split_after` marks a cut by a pipe_split() call in forward. The embedding is used
    again by the head (a value that must travel over every cut), and so is the mask (a model input)."""

    def __init__(self, split_after: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.split_after = split_after
        self.emb = nn.Linear(6, 16)
        self.layers = nn.ModuleList(Block(16) for _ in range(4))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = skip = self.emb(x)
        for i, layer in enumerate(self.layers):
            h = layer(h, mask)
            if i in self.split_after:
                pipe_split()
        return self.head(h * self.scale + skip)


def _net(split_after: tuple[int, ...] = ()) -> Net:
    torch.manual_seed(0)
    return Net(split_after).double()


def _inputs(rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 6, generator=gen, dtype=torch.float64)
    return x, (torch.rand(rows, 16, generator=gen) > 0.3).double()


def _chain(pipe: Pipe, *args, **kwargs):
    values = pipe.get_stage_module(0)(*args, **kwargs)
    for k in range(1, pipe.num_stages):
        values = pipe.get_stage_module(k)(*values)
    return values


def _names(pipe: Pipe) -> list[set[str]]:
    return [set(dict(pipe.get_stage_module(k).named_parameters())) for k in range(pipe.num_stages)]


def test_pipe_split_calls_cut_the_model_into_stages_that_compute_it() -> None:
    net, (x, mask) = _net((1,)), _inputs()
    pipe = pipeline(net, (x,), {"mask": mask})
    assert pipe.num_stages == 2
    torch.testing.assert_close(_chain(pipe, x, mask=mask), net(x, mask), rtol=0, atol=0)
    torch.testing.assert_close(pipe(x, mask=mask), net(x, mask), rtol=0, atol=0)
    first, second = _names(pipe)
    assert first == {"emb.weight", "emb.bias"} | {f"layers.{i}.{m}.{p}" for i in (0, 1) for m in ("norm", "lin")
                                                    for p in ("weight", "bias")}
    assert second == set(dict(net.named_parameters())) - first  # the model's own names, each on one stage
    assert pipe.get_stage_module(1).scale is net.scale  # the model's own parameters, not copies
    # What stage 1 needs from before the cut: the mask, the embedding (for the head) and the hidden state.
    assert len(pipe.get_stage_module(0)(x, mask=mask)) == 3


def test_split_spec_cuts_before_or_after_the_submodules_it_names() -> None:
    net, (x, _) = _net(), _inputs()
    pipe = pipeline(net, (x,), split_spec={"layers.1": SplitPoint.END, "layers.3": SplitPoint.BEGINNING})
    assert pipe.num_stages == 3
    assert [sorted({name.split(".")[1] for name in names if name.startswith("layers")}) for names in _names(pipe)] \
        == [["0", "1"], ["2"], ["3"]]
    torch.testing.assert_close(_chain(pipe, x), net(x), rtol=0, atol=0)  # mask left out: its default, None
    assert "forward" not in net.layers[1].__dict__  # the marks are gone once traced


def test_a_split_policy_places_the_marks() -> None:
    def after_blocks_1_and_2(gm: fx.GraphModule) -> fx.GraphModule:
        for node in list(gm.graph.nodes):
            if node.target is operator.add and node.name in ("add_1", "add_2"):  # the residual sums ending them
                with gm.graph.inserting_after(node):
                    gm.graph.call_function(pipe_split)
        gm.recompile()
        return gm

    net, (x, _) = _net(), _inputs()
    pipe = pipeline(net, (x,), split_policy=after_blocks_1_and_2)
    assert pipe.num_stages == 3
    torch.testing.assert_close(_chain(pipe, x), net(x), rtol=0, atol=0)


def test_tracing_leaves_the_model_as_it_was_and_takes_torchs_split_points() -> None:
    from torch.distributed.pipelining import SplitPoint as TorchSplitPoint

    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.drop, self.lin = nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor, *, scale: float = 2.0, shift: torch.Tensor | None = None) -> torch.Tensor:
            h = self.drop(self.norm(x)) * scale
            return self.lin(h if shift is None else h + shift)

    model, (x, _) = Normed().double(), _inputs()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.random.get_rng_state()
    pipe = pipeline(model, (x,), split_spec={"lin": TorchSplitPoint.BEGINNING})
    assert pipe.num_stages == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # running statistics untouched
    assert torch.equal(torch.random.get_rng_state(), state)  # dropout drew nothing from the generator
    # Arguments the example left out are baked in with their defaults, and no longer taken.
    torch.manual_seed(5)
    want = model(x)
    torch.manual_seed(5)
    torch.testing.assert_close(pipe(x), want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="shift"):
        pipe(x, shift=x[:, :6])


def test_cuts_that_cannot_work_are_refused() -> None:
    x, _ = _inputs()
    with pytest.raises(ValueError, match="give split_spec or split_policy, not both"):
        pipeline(_net(), (x,), split_spec={}, split_policy=lambda gm: gm)
    with pytest.raises(AttributeError, match=r"split_spec names 'layers\.9'"):
        pipeline(_net(), (x,), split_spec={"layers.9": SplitPoint.END})
    with pytest.raises(ValueError, match="stage 1 would compute nothing"):
        pipeline(_net((1,)), (x,), split_spec={"layers.1": SplitPoint.END})
    with pytest.raises(ValueError, match="stage 0 would compute nothing"):
        pipeline(_net(), (x,), split_spec={"emb": SplitPoint.BEGINNING})
    with pytest.raises(TypeError, match=r"forward needs \['x'\]"):
        pipeline(_net(), ())

    class Counts(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows = x.shape[0]
            pipe_split()
            return x.sum(dim=1) / rows

    with pytest.raises(TypeError, match="stage 0 would pass stage 1 int 4; only tensors travel between stages"):
        pipeline(Counts(), (x,))
    with pytest.raises(ValueError, match=r"stage_idx=2, but the pipe has stages 0 to 1"):
        pipeline(_net((1,)), (x,)).get_stage_module(2)


def _train(rank: int, world: int, frontend, with_mask: bool) -> dict:
    """Two steps of ScheduleGPipe on the traced pipe, written as torch's pipelining tutorial writes them.
    With the mask, stage 1 uses a model input (torch's frontend cannot: it sends stage 1 only stage 0's
    outputs; shoal passes the input along)."""
    net, (x, mask) = _net(), _inputs(8)
    y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(2))
    kwargs = {"mask": mask} if with_mask else {}
    pipe = frontend.pipeline(net, (x[:2],), {k: v[:2] for k, v in kwargs.items()},
                             split_spec={"layers.2": frontend.SplitPoint.BEGINNING})
    stage = (pipe.build_stage(rank, CPU) if rank == 0 else
             frontend.build_stage(pipe.get_stage_module(rank), rank, pipe.info(), CPU))
    schedule = frontend.ScheduleGPipe(stage, 4, loss_fn=nn.functional.cross_entropy)
    outs, losses = [], []
    for _ in range(2):
        stage.submod.zero_grad()
        if rank == 0:
            outs.append(schedule.step(x, **kwargs))
        else:
            outs.append(schedule.step(target=y, losses=losses))
    grads = {n: p.grad for n, p in stage.submod.named_parameters()}
    return {"outs": outs, "losses": losses, "grads": grads}


def _both(rank: int, world: int, torch_port: int) -> tuple[dict, dict]:
    import torch.distributed as torch_dist
    import torch.distributed.pipelining as torch_pp

    import shoal.pipeline as shoal_pp

    ours = _train(rank, world, shoal_pp, with_mask=False), _train(rank, world, shoal_pp, with_mask=True)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=world)
    try:
        theirs = _train(rank, world, torch_pp, with_mask=False)
    finally:
        torch_dist.destroy_process_group()
    return ours, theirs


def test_a_traced_pipe_trains_across_ranks_as_torchs_frontend_does() -> None:
    from shoal.ports import free_port

    out = run_ranks(_both, 2, free_port(), timeout=180)
    ((ours0, masked0), theirs0), ((ours1, masked1), theirs1) = out[0], out[1]
    assert ours0["outs"] == [None, None] and theirs0["outs"] == [None, None]
    for a, b in zip(ours1["outs"] + ours1["losses"], theirs1["outs"] + theirs1["losses"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    for mine, torchs in ((ours0, theirs0), (ours1, theirs1)):
        assert mine["grads"].keys() == torchs["grads"].keys()
        for name in mine["grads"]:
            torch.testing.assert_close(mine["grads"][name], torchs["grads"][name], rtol=0, atol=1e-12, msg=name)
    # Against the unsplit model: the gradient of the mean of the 4 micro-batches' mean losses.
    net, (x, mask) = _net(), _inputs(8)
    y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(2))
    rows = torch.tensor_split(torch.arange(8), 4)
    torch.stack([nn.functional.cross_entropy(net(x[r], mask[r]), y[r]) for r in rows]).mean().backward()
    grads = {**masked0["grads"], **masked1["grads"]}
    assert grads.keys() == dict(net.named_parameters()).keys()
    for name, parameter in net.named_parameters():
        torch.testing.assert_close(grads[name], parameter.grad, rtol=0, atol=1e-12, msg=name)
