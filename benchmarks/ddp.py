"""DDP step-time benchmark: shoal's DistributedDataParallel beside torch.nn.parallel's, same model, data
and backend, in the same processes (world size 2).

    python benchmarks/ddp.py            # or: shoal bench ddp
    python benchmarks/ddp.py --steps 10

A step is zero_grad, forward, loss, backward and an SGD step. The configurations take turns, one step
each per round, so that a machine whose speed drifts slows them alike. Besides the median step time it
reports the share of all-reduce time hidden behind backward: 1 - (DDP step - compute-only step) /
(time to all-reduce every gradient once, alone). A second table, from a pass of its own
(--tracing-steps), gives the cost of tracing: shoal DDP's step with a timeline being written (as under
`shoal run --trace`) beside the same step untraced: the median of the two's difference in each round,
plus the traced step's share of writing the timeline out. Beside it, PyTorch's counterpart: torch
DDP's step under torch.profiler.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks`, `tests` importable
from benchmarks._steps import interleaved, interleaved_times, training_step
from shoal.ports import free_port
from tests.ranks import run_ranks

MODELS = ("mlp-10M", "digits-cnn")
WRITE_EVERY = 10  # traced steps per write of the timeline
UNTRACED, TRACED, OVERHEAD = "shoal DDP (shoal), untraced", "shoal DDP (shoal), traced", "tracing overhead"
TORCH_UNTRACED, TORCH_PROFILED = "torch DDP (gloo), untraced", "torch DDP (gloo), under torch.profiler"


def _model_and_batch(name: str, rank: int):
    import torch
    from torch import nn

    from shoal.demo import digits_cnn

    torch.manual_seed(0)
    if name == "mlp-10M":
        model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                              nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                              nn.Linear(1024, 10))
        gen = torch.Generator().manual_seed(rank)
        batch = (torch.randn(64, 1024, generator=gen), torch.randint(0, 10, (64,), generator=gen))
    else:
        model = digits_cnn()
        gen = torch.Generator().manual_seed(rank)
        batch = (torch.rand(32, 1, 8, 8, generator=gen), torch.randint(0, 10, (32,), generator=gen))
    return model, batch


class _Traced:
    """`step` with `timeline` (a shoal.observe.timeline.Timeline that has no writer thread) attached while
    it runs, and only then. Every WRITE_EVERY-th call also writes the timeline's queue out, as the writer
    thread of a traced job would (it writes every 0.5 s: hundreds of small steps), but inside the step, so
    that its cost lands on this configuration; `writing_s` keeps each call's time spent writing."""

    def __init__(self, step, timeline) -> None:
        self.step, self.timeline = step, timeline
        self.writing_s: list[float] = []

    def __call__(self) -> None:
        from shoal.observe import events

        events.attach(self.timeline)
        try:
            self.step()
        finally:
            events.detach(self.timeline)
        start = time.perf_counter()
        if len(self.writing_s) % WRITE_EVERY == WRITE_EVERY - 1:
            self.timeline.write_out()
        self.writing_s.append(time.perf_counter() - start)

    def overhead(self, untraced: list[float], traced: list[float]) -> float:
        """What tracing adds to a step: the median, over rounds, of the traced step (less its writing) minus
        the untraced step of the same round, plus the mean time writing per step. Pairs of one round
        share the machine's mood of the moment, so their difference is steadier than two medians'; a
        median alone would miss the writing, and a mean would be as noisy as the slowest steps."""
        writing = self.writing_s[-len(traced):]
        paired = (t - w - u for u, t, w in zip(untraced, traced, writing, strict=True))
        return statistics.median(paired) + statistics.mean(writing)


def _under_torch_profiler(step, steps: int, barrier) -> dict[str, float]:
    """PyTorch's counterpart of tracing: torch DDP's step, untraced and then under torch.profiler
    recording CPU activity, in a block of `steps` each (the profiler has no cheap pause between steps)."""
    from torch.profiler import ProfilerActivity, profile

    untraced = statistics.median(interleaved_times({"": step}, steps, barrier)[""])
    with profile(activities=[ProfilerActivity.CPU]):
        profiled = statistics.median(interleaved_times({"": step}, steps, barrier)[""])
    return {TORCH_UNTRACED: untraced, TORCH_PROFILED: profiled}


def _worker(rank: int, world_size: int, port: int, native_port: int, torch_port: int, steps: int,
            tracing_steps: int) -> list[dict]:
    import tempfile

    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import shoal.distributed as dist
    from shoal.comm.backends.native import ShoalProcessGroup
    from shoal.comm.rendezvous import Endpoint, join
    from shoal.observe.timeline import Timeline
    from shoal.parallel import DistributedDataParallel as ShoalDDP

    torch.set_num_threads(1)
    timeout = timedelta(seconds=300)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timeout)
    gloo = dist.default_group()
    # torch DDP's own group: shoal's "gloo" leaves torch.distributed's default group to the script.
    tdist.init_process_group("gloo", f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=2, timeout=timeout)
    native = ShoalProcessGroup.create(join(Endpoint("127.0.0.1", native_port, rank, 2), timeout), rank, 2, timeout,
                                      "127.0.0.1")
    trace_dir = tempfile.TemporaryDirectory(prefix="shoal-bench-trace-")
    timeline = Timeline(Path(trace_dir.name), rank, write_every_s=None)
    rows = []
    for name in MODELS:
        model, batch = _model_and_batch(name, rank)
        params = sum(p.numel() for p in model.parameters())
        flat = torch.zeros(params)
        ops = {"compute": training_step(model, batch),
               "comm gloo": lambda t=flat: gloo.all_reduce(t).wait(),
               "comm shoal": lambda t=flat: native.all_reduce(t).wait(),
               "torch DDP (gloo)": training_step(TorchDDP(_model_and_batch(name, rank)[0]), batch),
               "shoal DDP (gloo)": training_step(ShoalDDP(_model_and_batch(name, rank)[0], process_group=gloo), batch),
               "shoal DDP (shoal)": training_step(ShoalDDP(_model_and_batch(name, rank)[0], process_group=native),
                                                  batch)}
        figures = interleaved(ops, steps, tdist.barrier)
        # Tracing costs a few percent at most: it gets a pass of its own, of more steps, for steadier medians.
        traced = _Traced(training_step(ShoalDDP(_model_and_batch(name, rank)[0], process_group=native), batch),
                         timeline)
        times = interleaved_times({UNTRACED: ops["shoal DDP (shoal)"], TRACED: traced}, tracing_steps, tdist.barrier)
        figures |= {UNTRACED: statistics.median(times[UNTRACED]),
                    OVERHEAD: traced.overhead(times[UNTRACED], times[TRACED])}
        figures |= _under_torch_profiler(ops["torch DDP (gloo)"], tracing_steps // 2, tdist.barrier)
        seconds = torch.tensor(list(figures.values()), dtype=torch.float64)
        tdist.all_reduce(seconds, op=tdist.ReduceOp.MAX)  # the slower rank sets the pace
        rows.append({"model": name, "params": params, **dict(zip(figures, seconds.tolist(), strict=True))})
    timeline.close()
    trace_dir.cleanup()
    native.shutdown()
    dist.destroy_process_group()
    tdist.destroy_process_group()
    return rows  # the same on every rank: each figure is the slower rank's


def run(steps: int, tracing_steps: int) -> list[dict]:
    return run_ranks(_worker, 2, free_port(), free_port(), steps, tracing_steps, backend=None, timeout=None)[0]


def _hidden(step: float, compute: float, comm: float) -> str:
    return f"{min(1.0, max(0.0, 1 - (step - compute) / comm)):.0%}"


def table(rows: list[dict]) -> list[str]:
    lines = ["| model | params | compute only | torch DDP (gloo) | shoal DDP (gloo) | ratio | shoal DDP (shoal) | "
             "ratio | all-reduce hidden: torch / shoal (gloo) / shoal (shoal) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        torch_t, ours_gloo, ours_native = r["torch DDP (gloo)"], r["shoal DDP (gloo)"], r["shoal DDP (shoal)"]
        hidden = " / ".join([_hidden(torch_t, r["compute"], r["comm gloo"]),
                             _hidden(ours_gloo, r["compute"], r["comm gloo"]),
                             _hidden(ours_native, r["compute"], r["comm shoal"])])
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['compute'] * 1e3:.1f} ms | "
                     f"{torch_t * 1e3:.1f} ms | {ours_gloo * 1e3:.1f} ms | {ours_gloo / torch_t:.2f}x | "
                     f"{ours_native * 1e3:.1f} ms | {ours_native / torch_t:.2f}x | {hidden} |")
    return lines


def tracing_table(rows: list[dict]) -> list[str]:
    lines = ["| model | shoal DDP (shoal) | traced | tracing overhead | torch DDP (gloo) | under torch.profiler | "
             "profiler overhead |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        plain, extra = r[UNTRACED], r[OVERHEAD]
        torch_plain, profiled = r[TORCH_UNTRACED], r[TORCH_PROFILED]
        lines.append(f"| {r['model']} | {plain * 1e3:.2f} ms | {(plain + extra) * 1e3:.2f} ms | {extra / plain:+.1%} | "
                     f"{torch_plain * 1e3:.2f} ms | {profiled * 1e3:.2f} ms | {profiled / torch_plain - 1:+.1%} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration (median taken)")
    parser.add_argument("--tracing-steps", type=int, default=400,
                        help="timed steps of the untraced and the traced step, in the pass that compares them")
    args = parser.parse_args(argv)
    rows = run(args.steps, args.tracing_steps)
    print("\n".join(table(rows)))
    print()
    print("\n".join(tracing_table(rows)))


if __name__ == "__main__":
    main(sys.argv[1:])
