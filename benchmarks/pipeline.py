"""Pipeline step-time benchmark: shoal's ScheduleGPipe and Schedule1F1B (backend "shoal") beside
torch.distributed.pipelining's (gloo), same two stages, batch and micro-batch counts, in the same processes.

    python benchmarks/pipeline.py                          # or: shoal bench pipeline
    python benchmarks/pipeline.py --steps 20 --plot docs/pipeline.png    # the plot needs matplotlib

Two stages of equal layers (Linear + ReLU), one torch thread per rank. A step is zero_grad,
the pipeline step and an SGD step; the variants take turns step by step (so that the drift of a
shared machine's speed falls on all alike), and each time is the median over the timed steps, slowest
rank. Two bubble figures, for every variant alike:

- idle: 1 - busy / T_pipe, where busy is the busiest stage's own compute in the step (its forwards,
  loss and backwards, timed where they run) and T_pipe the wall time of the pipeline step
  (schedule.step, slowest stage); median over steps. Theory for p equal stages: (p-1)/(m+p-1). The
  stages hold equal layers; stage 1 also computes the gradient of its input and the loss (about 1/12
  more work), so it is the busiest. The targets are judged on this figure.
- vs alone: 1 - T_ideal / T_step, where T_ideal is the same stage doing the same step's work
  (zero_grad, the forwards and backwards of all micro-batches, SGD) without a pipeline, on both ranks
  at once. It also counts compute that runs slower inside a pipeline than back to back.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks`, `tests` importable
from benchmarks.plots import pyplot, require_matplotlib
from shoal.ports import free_port
from tests.ranks import run_ranks

MICROBATCHES = (1, 2, 4, 8, 16)
VARIANTS = ("shoal GPipe", "torch GPipe", "shoal 1F1B", "torch 1F1B")
STAGES = 2
_busy = [0.0]  # seconds of forward, loss and backward compute in this process since the last reset


def _timed(fn):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _busy[0] += time.perf_counter() - start
    return timed


def _count_forwards(module) -> None:
    """Add the time of every forward of `module` to `_busy` (`_worker` times every backward)."""
    starts = []
    module.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))
    module.register_forward_hook(lambda *_: _busy.__setitem__(0, _busy[0] + time.perf_counter() - starts.pop()))


def _stage_module(rank: int, width: int, layers: int):
    import torch
    from torch import nn

    from shoal.pipeline import split_sequential

    torch.manual_seed(0)
    model = nn.Sequential(*[module for _ in range(STAGES * layers) for module in (nn.Linear(width, width), nn.ReLU())])
    return split_sequential(model, STAGES)[rank]


def _interleaved(steps: dict, timed: int, barrier, combine) -> dict[str, dict[str, float]]:
    """Per step function: median step time and median idle share, taking turns step by step.

    The idle share of a step is 1 - (the busiest stage's compute time) / (the pipeline step's wall time,
    which the slowest stage sets: the last stage returns before stage 0 has run its last backward).
    """
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for i in range(timed + 3):
        for name, step in steps.items():
            barrier()
            _busy[0] = 0.0
            start = time.perf_counter()
            pipe = step()
            seconds = time.perf_counter() - start
            busy, pipe = combine(_busy[0], pipe)  # outside the timed part
            if i >= 3:  # warm-up steps exchange shapes and build caches
                samples[name].append((seconds, 1 - busy / pipe))
    return {name: {"step": statistics.median(s for s, _ in values), "idle": statistics.median(i for _, i in values)}
            for name, values in samples.items()}


def _pipeline_step(variant: str, rank: int, module, m: int, batch, native):
    """A closure running one training step of `variant` on this rank; it returns the pipeline's part."""
    import torch
    import torch.distributed.pipelining as tpp
    from torch import nn

    import shoal.pipeline as spp

    x, y = batch
    _count_forwards(module)
    if variant.startswith("shoal"):
        stage = spp.PipelineStage(module, rank, STAGES, torch.device("cpu"), group=native)
        kind = spp.ScheduleGPipe if "GPipe" in variant else spp.Schedule1F1B
    else:
        stage = tpp.PipelineStage(module, rank, STAGES, torch.device("cpu"))
        kind = tpp.ScheduleGPipe if "GPipe" in variant else tpp.Schedule1F1B
    schedule = kind(stage, m, loss_fn=_timed(nn.functional.mse_loss))
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-4)

    def step() -> float:
        optimizer.zero_grad()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        pipe = time.perf_counter() - start
        optimizer.step()
        return pipe

    return step


def _alone_step(rank: int, module, m: int, batch):
    """The same stage's work for one step without a pipeline: what "vs alone" is measured against."""
    import torch
    from torch import nn

    x, y = batch
    _count_forwards(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-4)
    # As in the pipeline: stage 0 backpropagates a gradient it was sent, stage 1 a loss, and stage 1's
    # input (a received activation) requires grad, so that backward computes the gradient to send back.
    activations = [a.clone().requires_grad_(rank > 0) for a in torch.tensor_split(x, m)]
    targets = torch.tensor_split(y, m)
    grads = torch.tensor_split(torch.randn_like(y), m)

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        for j in range(m):
            if rank == 0:
                module(activations[j]).backward(grads[j])
            else:
                (nn.functional.mse_loss(module(activations[j]), targets[j]) * (len(targets[j]) / len(y))).backward()
        optimizer.step()
        return time.perf_counter() - start

    return step


def _combine(busy: float, pipe: float) -> tuple[float, float]:
    """The busiest stage's compute time and the longest pipeline time of one step."""
    import torch
    import torch.distributed as tdist

    both = torch.tensor([busy, pipe], dtype=torch.float64)
    tdist.all_reduce(both, op=tdist.ReduceOp.MAX)
    return both[0].item(), both[1].item()


def _worker(rank: int, world_size: int, port: int, native_port: int, args: argparse.Namespace) -> list[dict]:
    import torch
    import torch.distributed as tdist

    from shoal.comm.backends.native import ShoalProcessGroup
    from shoal.comm.rendezvous import Endpoint, join

    torch.set_num_threads(1)
    # Both pipelines run a full backward through torch.autograd.backward (Tensor.backward too): time them all.
    torch.autograd.backward = _timed(torch.autograd.backward)
    timeout = timedelta(seconds=300)
    # torch's pipelining runs on torch.distributed's default group.
    tdist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=STAGES, timeout=timeout)
    native = ShoalProcessGroup.create(join(Endpoint("127.0.0.1", native_port, rank, STAGES), timeout), rank, STAGES,
                                      timeout, "127.0.0.1")
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(args.batch, args.width, generator=gen), torch.randn(args.batch, args.width, generator=gen))
    module = _stage_module(rank, args.width, args.layers)
    rows = []
    for m in MICROBATCHES:
        steps = {"alone": _alone_step(rank, copy.deepcopy(module), m, batch)}
        for variant in VARIANTS:
            if variant == "torch 1F1B" and m < STAGES:
                continue  # torch's Schedule1F1B refuses fewer micro-batches than stages
            steps[variant] = _pipeline_step(variant, rank, copy.deepcopy(module), m, batch, native)
        measured = _interleaved(steps, args.steps, tdist.barrier, _combine)
        times = torch.tensor([measured[k]["step"] for k in steps], dtype=torch.float64)
        tdist.all_reduce(times, op=tdist.ReduceOp.MAX)  # the slower rank sets the pace
        row = {"m": m, **dict(zip(steps, times.tolist(), strict=True))}
        row["idle"] = {k: measured[k]["idle"] for k in steps if k != "alone"}  # the same on every rank
        rows.append(row)
    native.shutdown()
    tdist.destroy_process_group()
    return rows  # the same on every rank: the slower rank's times, and idle shares that every rank computes alike


def theory(m: int) -> float:
    return (STAGES - 1) / (m + STAGES - 1)


def vs_alone(row: dict, variant: str) -> float:
    return 1 - row["alone"] / row[variant]


def table(rows: list[dict]) -> list[str]:
    lines = ["| m | alone (T_ideal) | shoal GPipe | torch GPipe | ratio | shoal 1F1B | torch 1F1B | ratio | "
             "bubble theory | idle: shoal GPipe / torch GPipe / shoal 1F1B / torch 1F1B | vs alone: same order |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r['m']}", f"{r['alone'] * 1e3:.1f} ms"]
        for ours, theirs in (("shoal GPipe", "torch GPipe"), ("shoal 1F1B", "torch 1F1B")):
            cells.append(f"{r[ours] * 1e3:.1f} ms")
            cells += [f"{r[theirs] * 1e3:.1f} ms", f"{r[ours] / r[theirs]:.2f}x"] if theirs in r else ["n/a", "n/a"]
        cells.append(f"{theory(r['m']):.3f}")
        cells.append(" / ".join(f"{r['idle'][v]:.3f}" if v in r else "n/a" for v in VARIANTS))
        cells.append(" / ".join(f"{vs_alone(r, v):.3f}" if v in r else "n/a" for v in VARIANTS))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    fig, (times, bubbles) = plt.subplots(1, 2, figsize=(11, 4))
    for variant, style in zip(VARIANTS, ("o-", "s--", "^-", "v--"), strict=True):
        ms = [r["m"] for r in rows if variant in r]
        times.plot(ms, [r[variant] * 1e3 for r in rows if variant in r], style, label=variant)
        bubbles.plot(ms, [r["idle"][variant] for r in rows if variant in r], style, label=f"{variant}: idle")
    ms = [r["m"] for r in rows]
    times.plot(ms, [r["alone"] * 1e3 for r in rows], "k:", label="one stage alone (T_ideal)")
    bubbles.plot(ms, [theory(m) for m in ms], "k-", linewidth=2, label="theory (p-1)/(m+p-1)")
    bubbles.plot(ms, [vs_alone(r, "shoal 1F1B") for r in rows], "^:", color="grey",
                 label="shoal 1F1B: 1 - T_ideal/T_step")
    for ax, title, label in ((times, "training step time, 2 stages", "ms per step"),
                             (bubbles, "bubble: idle share of the pipeline step", "share of the step")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("micro-batches m")
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration (median taken)")
    parser.add_argument("--batch", type=int, default=256, help="rows per step, split into micro-batches")
    parser.add_argument("--width", type=int, default=1024, help="features of every Linear layer")
    parser.add_argument("--layers", type=int, default=4, help="Linear + ReLU layers per stage")
    parser.add_argument("--plot", type=Path, help="save step time and bubble against m here (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.plot is not None:
        require_matplotlib()
    rows = run_ranks(_worker, STAGES, free_port(), args, backend=None, timeout=None)[0]
    print("\n".join(table(rows)))
    if args.plot is not None:
        plot(rows, args.plot)
        print(f"plot saved to {args.plot}")


if __name__ == "__main__":
    main(sys.argv[1:])
