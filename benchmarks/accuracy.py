"""Time to accuracy across two hosts: the demo's model trained to 95% test accuracy with plain DDP, with
gradients compressed (bf16, PowerSGD) and with DiLoCo, over slow links; torch's DDP beside.

    shoal bench accuracy                            # links of 10 mbit, 100 mbit and 1 gbit
    shoal bench accuracy --links 100mbit --epochs 20
    shoal bench accuracy --plot docs/accuracy.png   # test accuracy against training seconds (needs matplotlib)

The hosts are tests/hosts.py's network namespaces, 2 ranks each, as in `shoal bench hosts` (root needed;
it says why and stops where it cannot build them). Every configuration trains shoal.demo's CNN on the
digits (Adam, lr 2e-3, 32 images per rank and step, a DistributedSampler) for the same number of epochs,
in fresh processes of its own, and evaluates the test set every EVAL_EVERY steps. Its clock counts
training steps only, not evaluations. A row gives the training seconds until the test accuracy first
reaches TARGET, and the accuracy after the last epoch; the plot, every evaluation's accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks`, `tests` importable
from benchmarks.hosts import PORT, RATES, run_across, shape_link
from benchmarks.plots import pyplot, require_matplotlib
from tests.hosts import TwoHosts, namespaces_missing

TARGET = 0.95
EVAL_EVERY = 6  # steps between evaluations: also DiLoCo's sync_every, so that it is evaluated when replicas agree
LR = 2e-3
METHODS = ("torch DDP fp32", "torch DDP fp16", "torch PowerSGD", "shoal DDP fp32", "shoal DDP bf16",
           "shoal PowerSGD", "shoal batched PowerSGD", "shoal DiLoCo")
POWERSGD = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 12}  # compressing after the first epoch
BATCHED = {**POWERSGD, "matrix_approximation_rank": 1}  # torch's advice for its batched variant
# What the link may send above its rate after a quiet while: 64 KB (one segment the kernel hands it at once).
# The evaluations leave the link idle every EVAL_EVERY steps; a bucket as deep as `shoal bench hosts`'s 1 MB
# would refill in them and carry a whole interval's gradients (6 x 153 KB) at once, above the rate.
BURST = "64kb"


def _model_and_optimizer(method: str, net):
    """The module to call and the optimizer to step, for `method`."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from shoal.optim import DiLoCoOptimizer
    from shoal.parallel import (
        DistributedDataParallel,
        PowerSGDState,
        batched_powerSGD_hook,
        bf16_compress_hook,
        powerSGD_hook,
    )

    inner = torch.optim.Adam(net.parameters(), lr=LR)
    if method == "shoal DiLoCo":
        outer = torch.optim.SGD(net.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        return net, DiLoCoOptimizer(inner, outer, sync_every=EVAL_EVERY)
    model = (TorchDDP if method.startswith("torch") else DistributedDataParallel)(net)
    hooks = {"torch DDP fp16": (None, default_hooks.fp16_compress_hook),
             "torch PowerSGD": (torch_powersgd.PowerSGDState(None, **POWERSGD), torch_powersgd.powerSGD_hook),
             "shoal DDP bf16": (None, bf16_compress_hook),
             "shoal PowerSGD": (PowerSGDState(None, **POWERSGD), powerSGD_hook),
             "shoal batched PowerSGD": (PowerSGDState(None, **BATCHED), batched_powerSGD_hook)}
    if method in hooks:
        model.register_comm_hook(*hooks[method])
    return model, inner


def _worker(rank: int, world: int, address: str, method: str, epochs: int, out: str) -> None:
    import torch
    import torch.distributed as tdist
    from torch import nn
    from torch.utils.data import DataLoader

    import shoal.distributed as dist
    from shoal.data import DistributedSampler
    from shoal.demo import accuracy, digits, digits_cnn

    torch.set_num_threads(1)
    timeout = timedelta(seconds=300)
    lib = tdist if method.startswith("torch") else dist
    lib.init_process_group("gloo" if lib is tdist else "shoal", f"tcp://{address}:{PORT}", rank=rank,
                           world_size=world, timeout=timeout)
    torch.manual_seed(0)
    train_set, test_set = digits()
    net = digits_cnn()
    model, optimizer = _model_and_optimizer(method, net)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    clock, steps, curve = 0.0, 0, []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            start = time.perf_counter()
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
            clock += time.perf_counter() - start
            steps += 1
            if steps % EVAL_EVERY == 0:
                curve.append((clock, steps, accuracy(net, test_set)))
    reached = next(({"seconds": seconds, "steps": step, "accuracy": acc} for seconds, step, acc in curve
                    if acc >= TARGET), None)
    result = {"reached": reached, "final": accuracy(net, test_set), "seconds": clock, "steps": steps,
              "curve": curve}
    lib.barrier()  # every rank past its last collective (and torch's hook callbacks) before the group goes
    lib.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(result))


# A colour per way of communicating, so that torch's method (dashed, hollow dot) and shoal's (solid) pair up.
_COLOURS = {"torch DDP fp32": "C0", "shoal DDP fp32": "C0", "torch DDP fp16": "C1", "shoal DDP bf16": "C1",
            "torch PowerSGD": "C2", "shoal PowerSGD": "C2", "shoal batched PowerSGD": "C8", "shoal DiLoCo": "C3"}


def plot(by_link: dict[str, dict[str, dict]], path: Path) -> None:
    """Test accuracy against training seconds, a panel per link and a line per method, with a dot at the
    evaluation where the method first reaches TARGET: how soon each gets there, and how steadily it stays."""
    plt = pyplot()
    from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter

    fig, axes = plt.subplots(len(by_link), 1, figsize=(9, 3.4 * len(by_link)), squeeze=False)
    for ax, (link, by_method) in zip(axes[:, 0], by_link.items(), strict=True):
        for method, r in by_method.items():
            if not r["curve"]:  # fewer steps than one evaluation's worth
                continue
            colour, is_torch = _COLOURS[method], method.startswith("torch")
            seconds, _, accuracies = zip(*r["curve"], strict=True)
            ax.plot(seconds, accuracies, "--" if is_torch else "-", color=colour, linewidth=1.2, label=method)
            if r["reached"]:
                ax.plot(r["reached"]["seconds"], r["reached"]["accuracy"], "o", color=colour,
                        markerfacecolor="white" if is_torch else colour)
        ax.axhline(TARGET, color="k", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))  # 0.5, 1, 2, 5 s: seconds, not powers of ten
        ax.xaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(0.8, 1.0)  # the climb to TARGET and after; the first epochs' lower values would flatten it
        ax.set_xlabel("training seconds (log scale)")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"2 hosts x 2 ranks, {link} link; a dot where a method first reaches {TARGET:.0%}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--links", nargs="+", choices=list(RATES), default=["10mbit", "100mbit", "1gbit"])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--plot", type=Path, help="save test accuracy against training seconds here (needs matplotlib)")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plot is not None:
        require_matplotlib()
    if args.worker:
        rank, world, address, method, epochs, out = args.worker
        _worker(int(rank), int(world), address, method, int(epochs), out)
        return
    missing = namespaces_missing()
    if missing is not None:
        print(f"shoal bench accuracy: {missing}")
        return
    print(f"| link | method | seconds to {TARGET:.0%} | steps | vs shoal DDP fp32 | final accuracy | "
          f"training seconds, {args.epochs} epochs |")
    print("|---|---|---|---|---|---|---|")
    hosts = TwoHosts.build()
    by_link: dict[str, dict[str, dict]] = {}
    try:
        for link in args.links:
            shape_link(hosts, RATES[link], burst=BURST)
            results = by_link[link] = {method: run_across(hosts, 2, __file__, [method, str(args.epochs)])
                                       for method in args.methods}
            base = (results.get("shoal DDP fp32") or {}).get("reached")
            for method, r in results.items():
                reached = r["reached"]
                to_target = f"{reached['seconds']:.2f}" if reached else "not reached"
                speedup = f"{base['seconds'] / reached['seconds']:.1f}x" if reached and base else "-"
                print(f"| {link} | {method} | {to_target} | {reached['steps'] if reached else '-'} | {speedup} | "
                      f"{r['final']:.1%} | {r['seconds']:.2f} |", flush=True)
    finally:
        hosts.tear_down()
    if args.plot is not None:
        plot(by_link, args.plot)
        print(f"plot saved to {args.plot}")


if __name__ == "__main__":
    main()
