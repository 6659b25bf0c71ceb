"""DDP step-time benchmark: shoal's DistributedDataParallel beside torch.nn.parallel's, same model, data
and backend, in the same processes (world size 2).

    python benchmarks/ddp.py            # or: shoal bench ddp
    python benchmarks/ddp.py --steps 10

A step is zero_grad, forward, loss, backward and an SGD step. The configurations take turns, one step
each per round, so that a machine whose speed drifts slows them alike. Besides the median step time it
reports the share of all-reduce time hidden behind backward: 1 - (DDP step - compute-only step) /
(time to all-reduce every gradient once, alone).
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks` importable
from benchmarks import _ranks
from benchmarks._steps import interleaved, training_step
from shoal.ports import free_port

MODELS = ("mlp-10M", "digits-cnn")


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


def _worker(rank: int, ports: tuple[int, int, int], steps: int, results) -> None:
    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import shoal.distributed as dist
    from shoal.comm.native import ShoalProcessGroup
    from shoal.comm.rendezvous import Endpoint, join
    from shoal.parallel import DistributedDataParallel as ShoalDDP

    torch.set_num_threads(1)
    timeout = timedelta(seconds=300)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=2, timeout=timeout)
    gloo = dist.default_group()
    # torch DDP's own group: shoal's "gloo" leaves torch.distributed's default group to the script.
    tdist.init_process_group("gloo", f"tcp://127.0.0.1:{ports[2]}", rank=rank, world_size=2, timeout=timeout)
    native = ShoalProcessGroup.create(join(Endpoint("127.0.0.1", ports[1], rank, 2), timeout), rank, 2, timeout,
                                      "127.0.0.1")
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
        medians = interleaved(ops, steps, tdist.barrier)
        seconds = torch.tensor(list(medians.values()), dtype=torch.float64)
        tdist.all_reduce(seconds, op=tdist.ReduceOp.MAX)  # the slower rank sets the pace
        rows.append({"model": name, "params": params, **dict(zip(medians, seconds.tolist(), strict=True))})
    if rank == 0:
        results.put(rows)
    native.shutdown()
    dist.destroy_process_group()
    tdist.destroy_process_group()


def run(steps: int) -> list[dict]:
    return _ranks.run(_worker, 2, (free_port(), free_port(), free_port()), steps)


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration (median taken)")
    args = parser.parse_args(argv)
    print("\n".join(table(run(args.steps))))


if __name__ == "__main__":
    main(sys.argv[1:])
