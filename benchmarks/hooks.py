"""DDP's communication hooks across two hosts: the step time of shoal's DDP with each hook beside torch's DDP
with torch's same hook, over a link of a given rate, and the bytes each sends.

    shoal bench hooks                         # 2 hosts x 2 ranks; links of 100 mbit and 1 gbit
    shoal bench hooks --links 1gbit --steps 5

The hosts are tests/hosts.py's network namespaces, as in `shoal bench hosts` (root needed; it says why and
stops where it cannot build them). The model is benchmarks/ddp.py's mlp-10M (40 MiB of float32 gradients).
The hooks: none (fp32 all-reduce), fp16_compress_hook, and PowerSGD of rank 4 (compressing from the third
step; the warm-up steps are not timed). shoal runs on its own backend, torch on gloo, in the same processes,
one step of each configuration in turn; a figure is the median over steps of the slowest rank's step.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks`, `tests` importable
from benchmarks._steps import interleaved_times, training_step
from benchmarks.ddp import _model_and_batch
from benchmarks.hosts import PORT, RATES, run_across, shape_link
from tests.hosts import TwoHosts, namespaces_missing

HOOKS = ("fp32", "fp16", "PowerSGD r=4")
_RANK = 4


def _hooked(ddp, lib: str, hook: str):
    """`ddp` with `hook`, from shoal.parallel or torch's ddp_comm_hooks; the PowerSGD state, if any."""
    if hook == "fp32":
        return None
    if lib == "shoal":
        from shoal.parallel import PowerSGDState, fp16_compress_hook, powerSGD_hook
    else:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    if hook == "fp16":
        ddp.register_comm_hook(None, fp16_compress_hook)
        return None
    state = PowerSGDState(None, matrix_approximation_rank=_RANK, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powerSGD_hook)
    return state


def _worker(rank: int, world: int, address: str, steps: int, out: str) -> None:
    import statistics

    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import shoal.distributed as dist
    from shoal.parallel import DistributedDataParallel as ShoalDDP

    torch.set_num_threads(1)
    timeout = timedelta(seconds=600)
    dist.init_process_group("shoal", f"tcp://{address}:{PORT}", rank=rank, world_size=world, timeout=timeout)
    tdist.init_process_group("gloo", f"tcp://{address}:{PORT + 1}", rank=rank, world_size=world, timeout=timeout)
    ops, rates = {}, {}
    for hook in HOOKS:
        for lib, ddp_cls in (("shoal", ShoalDDP), ("torch", TorchDDP)):
            model, batch = _model_and_batch("mlp-10M", rank)
            ddp = ddp_cls(model)
            state = _hooked(ddp, lib, hook)
            ops[(hook, lib)] = training_step(ddp, batch)
            rates[(hook, lib)] = state
    times = interleaved_times(ops, steps, dist.barrier)
    slowest = torch.tensor([times[key] for key in ops], dtype=torch.float64)
    tdist.all_reduce(slowest, op=tdist.ReduceOp.MAX)
    rows = []
    for (hook, lib), per_step in zip(ops, slowest.tolist(), strict=True):
        state = rates[(hook, lib)]
        ratio = 1.0 if state is None else state.compression_stats()[0]
        rows.append({"hook": hook, "lib": lib, "seconds": statistics.median(per_step),
                     "compression": 2.0 if hook == "fp16" else ratio})
    tdist.barrier()  # past torch's PowerSGD callbacks before its group goes (see tests/test_powersgd.py)
    tdist.destroy_process_group()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--links", nargs="+", choices=list(RATES), default=["100mbit", "1gbit"])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration (median taken)")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        rank, world, address, steps, out = args.worker
        _worker(int(rank), int(world), address, int(steps), out)
        return
    missing = namespaces_missing()
    if missing is not None:
        print(f"shoal bench hooks: {missing}")
        return
    print("| link | hook | sent / fp32 | torch DDP (gloo) | shoal DDP (shoal) | shoal speed-up |")
    print("|---|---|---|---|---|---|")
    hosts = TwoHosts.build()
    try:
        for link in args.links:
            shape_link(hosts, RATES[link])
            rows = run_across(hosts, 2, __file__, [str(args.steps)])
            for hook in HOOKS:
                mine, theirs = (next(r for r in rows if r["hook"] == hook and r["lib"] == lib)
                                for lib in ("shoal", "torch"))
                print(f"| {link} | {hook} | 1/{mine['compression']:.0f} | {theirs['seconds'] * 1e3:.0f} ms | "
                      f"{mine['seconds'] * 1e3:.0f} ms | {theirs['seconds'] / mine['seconds']:.2f}x |", flush=True)
    finally:
        hosts.tear_down()


if __name__ == "__main__":
    main()
