"""DataParallel against DistributedDataParallel, the comparison PyTorch's tutorials make, measured: one
process, shoal's and torch's DataParallel (threads in one process) and shoal's and torch's DDP (two
processes), on a model of many small layers and on a model of a few large matrix products.

    python benchmarks/dp_vs_ddp.py                              # or: shoal bench dp
    python benchmarks/dp_vs_ddp.py --rounds 5 --plot docs/dp_vs_ddp.png   # the plot needs matplotlib

Every configuration trains on the same global batch (DDP: half on each rank) with SGD. A step is
zero_grad, forward, loss, backward and the optimizer step; its time is the median over the timed
steps, and the median of that over rounds, which run the configurations interleaved so that a
noisy machine spreads its noise evenly. CPU use is the process CPU time (all threads; for DDP both
ranks) divided by wall time, in cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks`, `tests` importable
from benchmarks._steps import train_steps
from benchmarks.plots import pyplot, require_matplotlib
from shoal.ports import free_port
from tests.ranks import run_ranks

MODELS = {  # name: (global batch, what it stresses)
    "small-layers": (64, "48 Linear(32, 32) + ReLU: time goes to Python and per-operator overhead"),
    "large-matmuls": (128, "Linear(1024, 4096), Linear(4096, 4096), Linear(4096, 10): time goes to matrix products"),
}
IN_PROCESS = ("one process", "shoal DataParallel", "torch DataParallel")
DISTRIBUTED = ("shoal DDP", "torch DDP")


def _model(name: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "small-layers":
        return nn.Sequential(*[m for _ in range(48) for m in (nn.Linear(32, 32), nn.ReLU())], nn.Linear(32, 10))
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))


def _batch(name: str, rows: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    width = 32 if name == "small-layers" else 1024
    return torch.randn(rows, width, generator=gen), torch.randint(0, 10, (rows,), generator=gen)


def _in_process(name: str, config: str, steps: int) -> tuple[float, float]:
    import torch

    from shoal.parallel import DataParallel

    model = _model(name)
    if config == "shoal DataParallel":
        model = DataParallel(model, replicas=2)
    elif config == "torch DataParallel":
        model = torch.nn.DataParallel(model)  # without CUDA it runs the module itself, on this thread
    times = train_steps(model, _batch(name, MODELS[name][0], 0), steps)
    return times.median, times.cpu / times.wall


def _rank(rank: int, world_size: int, port: int, native_port: int, name: str, steps: int) -> dict:
    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from shoal.comm.backends.native import ShoalProcessGroup
    from shoal.comm.rendezvous import Endpoint, join
    from shoal.parallel import DistributedDataParallel as ShoalDDP

    torch.set_num_threads(1)  # one core per rank
    timeout = timedelta(seconds=300)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                             timeout=timeout)
    native = ShoalProcessGroup.create(join(Endpoint("127.0.0.1", native_port, rank, 2), timeout), rank, 2, timeout,
                                      "127.0.0.1")
    batch = _batch(name, MODELS[name][0] // 2, 1 + rank)
    row = {}
    for config, model in (("shoal DDP", ShoalDDP(_model(name), process_group=native)),
                          ("torch DDP", TorchDDP(_model(name)))):
        times = train_steps(model, batch, steps, tdist.barrier)
        maxima = torch.tensor([times.median, times.wall], dtype=torch.float64)
        tdist.all_reduce(maxima, op=tdist.ReduceOp.MAX)  # the slower rank sets the pace
        cpu_total = torch.tensor([times.cpu], dtype=torch.float64)
        tdist.all_reduce(cpu_total)
        row[config] = (maxima[0].item(), cpu_total.item() / maxima[1].item())
    native.shutdown()
    tdist.destroy_process_group()
    return row  # the same on every rank: the slower rank's times, and the cores both used


def run(steps: int, rounds: int) -> dict[str, dict[str, tuple[float, float]]]:
    """model -> configuration -> (median step seconds, CPU cores used)."""
    import torch

    torch.set_num_threads(2)  # the in-process configurations may use both cores, as a user's would
    samples: dict[str, dict[str, list[tuple[float, float]]]] = {m: {} for m in MODELS}
    for _ in range(rounds):
        for name in MODELS:
            for config in IN_PROCESS:
                samples[name].setdefault(config, []).append(_in_process(name, config, steps))
            for config, value in run_ranks(_rank, 2, free_port(), name, steps, backend=None, timeout=600)[0].items():
                samples[name].setdefault(config, []).append(value)
    return {name: {config: (statistics.median(s for s, _ in values), statistics.median(c for _, c in values))
                   for config, values in configs.items()} for name, configs in samples.items()}


def table(results: dict[str, dict[str, tuple[float, float]]]) -> list[str]:
    lines = ["| model | global batch | configuration | step | samples/s | vs one process | CPU cores used |",
             "|---|---|---|---|---|---|---|"]
    for name, configs in results.items():
        batch = MODELS[name][0]
        alone = configs["one process"][0]
        for config in (*IN_PROCESS, *DISTRIBUTED):
            step, cores = configs[config]
            lines.append(f"| {name} | {batch} | {config} | {step * 1e3:.1f} ms | {batch / step:,.0f} | "
                         f"{alone / step:.2f}x | {cores:.2f} |")
    return lines


def plot(results: dict[str, dict[str, tuple[float, float]]], path: Path) -> None:
    plt = pyplot()

    configs = (*IN_PROCESS, *DISTRIBUTED)
    fig, axes = plt.subplots(1, len(results), figsize=(11, 4.2))
    for ax, (name, row) in zip(axes, results.items(), strict=True):
        speed = [MODELS[name][0] / row[c][0] for c in configs]
        bars = ax.bar(range(len(configs)), speed, color=["#888", "#1f77b4", "#aec7e8", "#d62728", "#ff9896"])
        for bar, config in zip(bars, configs, strict=True):
            ax.annotate(f"{row[config][1]:.1f} cores", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(configs)), [c.replace(" ", "\n", 1) for c in configs], fontsize=8)
        ax.set_title(f"{name} (global batch {MODELS[name][0]})")
        ax.set_ylabel("samples/s")
    fig.suptitle("One process vs DataParallel (threads) vs DDP (2 processes), 2 CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration (median taken)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all configurations (median taken)")
    parser.add_argument("--plot", type=Path, help="save a bar chart of samples/s here (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.plot:
        require_matplotlib()
    results = run(args.steps, args.rounds)
    print("\n".join(table(results)))
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main(sys.argv[1:])
