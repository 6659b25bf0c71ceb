"""All-reduce benchmark: shoal's own backend beside torch.distributed's gloo, in the same processes.

    python benchmarks/allreduce.py                 # world sizes 2 and 4, 4 KiB .. 64 MiB
    python benchmarks/allreduce.py --quick         # world size 2, fewer repetitions
    shoal bench allreduce --markdown docs/x.md     # same, also writing a markdown table

For each float32 size it reports the median time of one all-reduce, algbw = bytes / time and
busbw = algbw * 2(n-1)/n (the traffic each link carries in a ring, as nccl-tests define it).
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks`, `tests` importable
from benchmarks._steps import slowest_call
from shoal.ports import free_port
from tests.ranks import run_ranks

SIZES = {"4KiB": 4 << 10, "256KiB": 256 << 10, "4MiB": 4 << 20, "64MiB": 64 << 20}


def _worker(rank: int, world_size: int, port: int, gloo_port: int, sizes: list[str], repeats: int) -> list:
    import torch
    import torch.distributed as tdist

    import shoal.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("shoal", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    tdist.init_process_group("gloo", f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world_size,
                             timeout=timedelta(seconds=120))
    rows = []
    for label in sizes:
        nbytes = SIZES[label]
        tensor = torch.ones(nbytes // 4)
        # One batch of each in turn: this machine's speed drifts, and should slow both alike.
        times = slowest_call({"shoal": partial(dist.all_reduce, tensor), "gloo": partial(tdist.all_reduce, tensor)},
                             nbytes, repeats, dist.barrier)
        rows.append((label, nbytes, times))
    tdist.destroy_process_group()
    dist.destroy_process_group()
    return rows  # the same on every rank: each time is the slowest rank's


def run(world_size: int, sizes: list[str], repeats: int) -> list:
    return run_ranks(_worker, world_size, free_port(), sizes, repeats, backend=None, timeout=None)[0]


def table(world_size: int, rows: list) -> list[str]:
    factor = 2 * (world_size - 1) / world_size
    lines = ["| n | size | shoal time | gloo time | shoal busbw | gloo busbw | busbw ratio shoal/gloo |",
             "|---|---|---|---|---|---|---|"]
    for label, nbytes, t in rows:
        bus = {k: nbytes / v * factor / 1e9 for k, v in t.items()}
        lines.append(f"| {world_size} | {label} | {t['shoal'] * 1e6:,.0f} us | {t['gloo'] * 1e6:,.0f} us | "
                     f"{bus['shoal']:.2f} GB/s | {bus['gloo']:.2f} GB/s | {bus['shoal'] / bus['gloo']:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--repeats", type=int, default=7, help="timed batches per size and backend (median taken)")
    parser.add_argument("--quick", action="store_true", help="world size 2 and 3 repeats")
    parser.add_argument("--markdown", help="also append the table to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.world_sizes, args.repeats = [2], 3
    lines = []
    for world_size in args.world_sizes:
        lines += table(world_size, run(world_size, args.sizes, args.repeats))
        if world_size != args.world_sizes[-1]:
            lines.append("")
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
