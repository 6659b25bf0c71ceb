"""torch's own programs on backend "shoal" beside the same programs on gloo, in the same processes.

    python benchmarks/torch_backend.py             # or: shoal bench torch-backend (world sizes 2 and 4)
    python benchmarks/torch_backend.py --quick     # world size 2, fewer repetitions

Each rank initializes torch.distributed with backend "shoal" and makes a gloo group of the same ranks
beside it, so the two run the same torch calls, taking turns (one batch or step of each per round, so
that a machine whose speed drifts slows both alike). It reports:
- all_gather_into_tensor and reduce_scatter_tensor (float32; the size is the larger of the output or
  input): median time and busbw = size / time * (n-1)/n, as nccl-tests define it;
- a step (zero_grad, forward, loss, backward, SGD) of torch's DistributedDataParallel on a 10M-parameter
  MLP, and of FSDP2 (`fully_shard` per block) on a small GPT: median step time.
Times are the slowest rank's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks`, `tests` importable
from benchmarks._steps import batched, collector_paused, interleaved, training_step
from tests.ranks import run_ranks

SIZES = {"4MiB": 4 << 20, "64MiB": 64 << 20}
BACKENDS = ("shoal", "gloo")


def _small_gpt():
    import torch

    from tests.small_gpt import SmallGPT

    torch.manual_seed(0)
    return SmallGPT(vocab=2048, dim=256, blocks=4, heads=8)


def _steps(rank: int, groups: dict) -> dict[str, Callable[[], None]]:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks.ddp import _model_and_batch

    steps = {}
    for backend, group in groups.items():
        model, batch = _model_and_batch("mlp-10M", rank)
        steps[f"torch DDP step, mlp-10M ({backend})"] = training_step(
            DistributedDataParallel(model, process_group=group), batch)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 2048, (4, 65), generator=gen)
    batch = (tokens[:, :-1], tokens[:, 1:].flatten())
    for backend, group in groups.items():
        gpt = _small_gpt()
        mesh = DeviceMesh.from_group(group, "cpu")
        for block in gpt.blocks:
            fully_shard(block, mesh=mesh)
        steps[f"FSDP2 step, small GPT ({backend})"] = training_step(fully_shard(gpt, mesh=mesh), batch)
    return steps


def _worker(rank: int, world_size: int, port: int, sizes: list[str], repeats: int, steps: int) -> list:
    import warnings

    import torch
    import torch.distributed as tdist

    import shoal  # noqa: F401 - registers backend "shoal"

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    tdist.init_process_group("shoal", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                             timeout=timedelta(seconds=300))
    groups = {"shoal": tdist.group.WORLD, "gloo": tdist.new_group(backend="gloo")}

    def barrier() -> None:
        tdist.barrier(group=groups["gloo"])

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=groups["gloo"])  # the slowest rank sets the pace
        return t.item()

    rows = []
    for label in sizes:
        nbytes = SIZES[label]
        big, small = torch.ones(nbytes // 4), torch.ones(nbytes // 4 // world_size)
        for name, call in (("all_gather_into_tensor", partial(tdist.all_gather_into_tensor, big, small)),
                           ("reduce_scatter_tensor", partial(tdist.reduce_scatter_tensor, small, big))):
            batches = {backend: batched(partial(call, group=group), nbytes) for backend, group in groups.items()}
            with collector_paused():
                medians = interleaved({b: batch for b, (batch, _) in batches.items()}, repeats, barrier)
            rows.append(("op", f"{name} {label}", nbytes,
                         {b: slowest(medians[b] / batches[b][1]) for b in BACKENDS}))
    medians = interleaved(_steps(rank, groups), steps, barrier)
    for label in dict.fromkeys(k.rsplit(" (", 1)[0] for k in medians):
        rows.append(("step", label, 0, {b: slowest(medians[f"{label} ({b})"]) for b in BACKENDS}))
    tdist.destroy_process_group()
    return rows


def table(world_size: int, rows: list) -> list[str]:
    factor = (world_size - 1) / world_size
    lines = ["| n | what | shoal | gloo | shoal busbw | gloo busbw | shoal/gloo |", "|---|---|---|---|---|---|---|"]
    for kind, label, nbytes, t in rows:
        if kind == "op":
            bus = {b: nbytes / t[b] * factor / 1e9 for b in BACKENDS}
            lines.append(f"| {world_size} | {label} | {t['shoal'] * 1e3:,.2f} ms | {t['gloo'] * 1e3:,.2f} ms | "
                         f"{bus['shoal']:.2f} GB/s | {bus['gloo']:.2f} GB/s | "
                         f"busbw {bus['shoal'] / bus['gloo']:.2f}x |")
        else:
            lines.append(f"| {world_size} | {label} | {t['shoal'] * 1e3:,.1f} ms | {t['gloo'] * 1e3:,.1f} ms | | | "
                         f"time {t['shoal'] / t['gloo']:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="*", choices=list(SIZES), default=list(SIZES),
                        help="sizes of the op rows (none: the training steps only)")
    parser.add_argument("--repeats", type=int, default=7, help="timed batches per op and backend (median taken)")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per program and backend")
    parser.add_argument("--quick", action="store_true", help="world size 2, 3 repeats, 4 steps")
    parser.add_argument("--markdown", help="also append the table to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.world_sizes, args.repeats, args.steps = [2], 3, 4
    lines = []
    for world_size in args.world_sizes:
        rows = run_ranks(_worker, world_size, args.sizes, args.repeats, args.steps, backend=None,
                         timeout=None)[0]
        lines += [*table(world_size, rows), ""]
    print("\n".join(lines).rstrip())
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
