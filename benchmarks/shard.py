"""Sharded training: shoal's fully_shard beside torch's, and what each rank holds under DDP, ZeRO-1, ZeRO-2 and
fully_shard.

    python benchmarks/shard.py              # or: shoal bench shard (4 ranks)
    python benchmarks/shard.py --quick      # 2 ranks, a smaller model, fewer steps
    python benchmarks/shard.py --cap        # also under a per-rank memory cap (root, cgroup v1)
    python benchmarks/shard.py --large      # memory only, ZeRO-2 and fully_shard, Adam state 2.1 GB

Two parts, each with fresh processes:
- step time: a step (zero_grad, forward, loss, backward, SGD) of a GPT sharded block by block, with shoal's
  `shoal.parallel.fully_shard` over shoal's collectives, torch's `torch.distributed.fsdp.fully_shard` over
  gloo, and torch's over shoal's torch backend, taken in turn in the same processes: the slowest rank's
  median;
- memory: one run per way of training a larger GPT with Adam (shoal's DistributedDataParallel; it with
  shoal's ZeroRedundancyOptimizer; shoal's fully_shard on the embedding, each block and the head, as
  torchtitan shards, and the same with reshard_after_forward=False, ZeRO-2 as FSDP makes it), a few steps
  each: the most any rank's resident memory grew over what it was before the model was made (its peak,
  from getrusage), less what the same run grows with a toy model (the cost of a process that trains at all:
  autograd's and the transport's threads and buffers), beside the model's state per rank (16 bytes per
  parameter for DDP with Adam, 16 / N for fully_shard). glibc's mmap threshold is fixed
  (MALLOC_MMAP_THRESHOLD_), so that a freed buffer leaves the resident set and the peak is what was live at
  once, not the heap's high-water mark;
- with --cap: DDP and fully_shard again, each rank in a memory cgroup of its own, which caps what the rank
  allocates from its start (what it held before stays charged where it was) halfway between the two's peak
  growth: whether each trains or is killed over the cap.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks`, `tests` importable
from benchmarks._steps import interleaved, training_step
from tests.ranks import RankFailed, run_ranks

MODELS = {"step": dict(vocab=2048, dim=256, blocks=4, heads=8), "memory": dict(vocab=8192, dim=512, blocks=8, heads=8)}
QUICK_MODELS = {"step": MODELS["step"], "memory": dict(vocab=4096, dim=256, blocks=4, heads=8)}
TOY = dict(vocab=64, dim=16, blocks=1, heads=2)
LARGE = dict(vocab=16384, dim=1024, blocks=18, heads=16)  # 260.3M parameters: Adam's state is 2.1 GB
WAYS = ("DDP", "ZeRO-1", "ZeRO-2", "fully_shard")  # ZeRO-2: fully_shard(reshard_after_forward=False)


def _gpt(shape: dict):
    import torch

    from tests.small_gpt import SmallGPT

    torch.manual_seed(0)
    return SmallGPT(**shape)


def _batch(rank: int, vocab: int):
    import torch

    tokens = torch.randint(0, vocab, (4, 65), generator=torch.Generator().manual_seed(rank))
    return tokens[:, :-1], tokens[:, 1:].flatten()


def _step_worker(rank: int, world: int, shape: dict, steps: int) -> dict[str, float]:
    import torch
    import torch.distributed as tdist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shoal.parallel import fully_shard

    gloo = tdist.new_group(backend="gloo")
    programs: dict[str, Callable[[], None]] = {}
    batch = _batch(rank, shape["vocab"])
    ours = _gpt(shape)
    for block in ours.blocks:
        fully_shard(block)
    programs["shoal fully_shard"] = training_step(fully_shard(ours), batch)
    for label, group in (("torch fully_shard on gloo", gloo), ("torch fully_shard on shoal", tdist.group.WORLD)):
        theirs, mesh = _gpt(shape), DeviceMesh.from_group(group, "cpu")
        for block in theirs.blocks:
            torch_fully_shard(block, mesh=mesh)
        programs[label] = training_step(torch_fully_shard(theirs, mesh=mesh), batch)
    medians = interleaved(programs, steps, lambda: tdist.barrier(group=gloo))
    slowest = {}
    for label, seconds in medians.items():
        t = torch.tensor([seconds], dtype=torch.float64)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=gloo)
        slowest[label] = t.item()
    return slowest


def _resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory_worker(rank: int, world: int, shape: dict, way: str, steps: int, cap: Path | None = None
                   ) -> dict[str, float]:
    import gc
    import resource

    import torch
    from torch import nn

    from shoal.optim import ZeroRedundancyOptimizer
    from shoal.parallel import DistributedDataParallel, fully_shard

    if cap is not None:  # this rank's own memory cgroup: what it allocates from here on counts against the cap
        (cap / f"rank{rank}" / "cgroup.procs").write_text(str(os.getpid()))

    gc.collect()
    before = _resident_bytes()
    model = _gpt(shape)
    params = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in part.parameters()) for part in (model.embed, *model.blocks, model.head))
    if way in ("ZeRO-2", "fully_shard"):
        for part in (model.embed, *model.blocks, model.head):
            fully_shard(part, reshard_after_forward=way == "fully_shard")
        model = fully_shard(model)
    else:
        model = DistributedDataParallel(model)
    if way == "ZeRO-1":
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = _batch(rank, shape["vocab"])
    saved: dict[int, int] = {}  # what autograd keeps for backward, by storage: the activations

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # fully_shard's whole ones too
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor
    for step in range(steps):
        with torch.autograd.graph.saved_tensors_hooks(keep if step == 0 else lambda t: t, lambda t: t):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"growth": peak - before, "params": params, "largest": largest, "activations": sum(saved.values())}


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _step_table(n: int, shape: dict, steps: int) -> list[str]:
    times = run_ranks(_step_worker, n, shape, steps, timeout=None)[0]
    gloo = times["torch fully_shard on gloo"]
    lines = [f"step time, GPT {shape}, {n} ranks (slowest rank's median of {steps}):", "",
             "| program | step | / torch on gloo |", "|---|---|---|"]
    return lines + [f"| {label} | {seconds * 1e3:,.1f} ms | {seconds / gloo:.2f}x |"
                    for label, seconds in times.items()]


def _memory_table(n: int, shape: dict, steps: int, ways: tuple[str, ...] = WAYS
                  ) -> tuple[list[str], dict[str, float]]:
    """The table, and each way's largest peak growth (toy's included)."""
    lines = ["", f"memory, GPT {shape}, Adam, {n} ranks (the largest rank's peak resident growth, less a toy "
             f"model's):", "", "| training | toy's growth | peak growth less toy's | model state per rank | "
             "activations | / (state + activations + what is gathered whole: ZeRO-2 all, fully_shard the largest "
             "module) |", "|---|---|---|---|---|---|"]
    growths = {}
    for way in ways:
        toy = max(r["growth"] for r in run_ranks(_memory_worker, n, TOY, way, steps, timeout=None).values())
        out = run_ranks(_memory_worker, n, shape, way, steps, timeout=None)
        growth = max(result["growth"] for result in out.values()) - toy
        growths[way] = max(result["growth"] for result in out.values())
        params, largest, activations = out[0]["params"], out[0]["largest"], out[0]["activations"]
        # DDP and ZeRO-1 hold whole parameters and gradients (4 + 4 bytes each); Adam's state is 8 bytes, all
        # of it under DDP, 1/N under ZeRO-1. fully_shard holds 1/N of all 16, and one module's whole
        # parameters (4 bytes each) while it computes; ZeRO-2 all of them, from the end of forward until
        # backward has reduced their gradients.
        state = {"DDP": 16 * params, "ZeRO-1": 8 * params + 8 * params / n}.get(way, 16 * params / n)
        gathered = {"ZeRO-2": 4 * params, "fully_shard": 4 * largest}.get(way, 0)
        lines.append(f"| {way} | {_mib(toy)} | {_mib(growth)} | {_mib(state)} | {_mib(activations)} | "
                     f"{growth / (state + activations + gathered):.2f}x |")
    return lines, growths


def _capped_table(n: int, shape: dict, steps: int, cap: int) -> list[str]:
    """DDP and fully_shard again, each rank in a memory cgroup of its own that caps what it allocates after it
    starts (the model, its training) at `cap` bytes: the kernel kills a rank that needs more."""
    root = Path("/sys/fs/cgroup/memory")
    lines = ["", f"under a cap of {_mib(cap)} per rank on what it allocates once started (a memory cgroup each):",
             "", "| training | outcome |",
             "|---|---|"]
    for way in ("DDP", "fully_shard"):
        cgroups = root / f"shoal-bench-shard-{os.getpid()}"
        for rank in range(n):
            (cgroups / f"rank{rank}").mkdir(parents=True)
            (cgroups / f"rank{rank}" / "memory.limit_in_bytes").write_text(str(cap))
        try:
            run_ranks(_memory_worker, n, shape, way, steps, cgroups, timeout=None)
            outcome = f"trained {steps} steps"
        except RankFailed as exc:
            killed = sum(int((cgroups / f"rank{r}" / "memory.failcnt").read_text()) > 0 for r in range(n))
            outcome = f"killed over the cap ({killed} of {n} ranks hit it): {str(exc).splitlines()[0]}"
        finally:
            for rank in range(n):
                (cgroups / f"rank{rank}").rmdir()
            cgroups.rmdir()
        lines.append(f"| {way} | {outcome} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per program")
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--cap", action="store_true", help="also train DDP and fully_shard with each rank's memory "
                        "growth capped halfway between their peaks (needs root and cgroup v1's memory controller)")
    parser.add_argument("--quick", action="store_true", help="2 ranks, a smaller model for memory, 4 steps")
    parser.add_argument("--large", action="store_true", help="memory only, of ZeRO-2 and fully_shard, training a "
                        "260.3M-parameter GPT whose Adam state is 2.1 GB (DDP's would need 4.2 GB per rank)")
    args = parser.parse_args(argv)
    if args.large:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        print("\n".join(_memory_table(args.world_size, LARGE, args.memory_steps, ("ZeRO-2", "fully_shard"))[0]))
        return
    models = QUICK_MODELS if args.quick else MODELS
    if args.quick:
        args.world_size, args.steps = 2, 4
    if args.cap and not os.access("/sys/fs/cgroup/memory", os.W_OK):
        raise SystemExit("--cap needs root and cgroup v1's memory controller at /sys/fs/cgroup/memory")
    lines = _step_table(args.world_size, models["step"], args.steps)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # the spawned ranks inherit it
    table, growths = _memory_table(args.world_size, models["memory"], args.memory_steps)
    lines += table
    if args.cap:
        cap = (growths["DDP"] + growths["fully_shard"]) // 2
        lines += _capped_table(args.world_size, models["memory"], args.memory_steps, cap)
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
