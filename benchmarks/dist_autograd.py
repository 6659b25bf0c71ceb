"""Distributed autograd benchmark: the step time of model-parallel training over RPC, shoal beside torch.distributed.

shoal's rpc, autograd, optim.DistributedOptimizer and nn.RemoteModule against torch.distributed's
(rpc over TensorPipe, autograd, optim, nn), in one program.

    python benchmarks/dist_autograd.py                # or: shoal bench autograd [--steps 200] [--rounds 2]
    shoal bench autograd --steps 20 --rounds 1 --markdown docs/x.md

Three workers: "ps" holds an nn.EmbeddingBag (100k x 64) as a RemoteModule, "mlp" holds two
Linear+ReLU layers as another, and the "trainer" holds the final Linear. One step, on the trainer:

    with dist_autograd.context() as ctx:
        loss = cross_entropy(head(mlp(embedding(indices, offsets))), target)    # two RPCs
        dist_autograd.backward(ctx, [loss])                   # gradients go back trainer->mlp->ps
        optimizer.step(ctx)                                   # DistributedOptimizer(SGD) on all three

The same code runs with torch's modules and with shoal's, each run on three freshly spawned
processes, `--rounds` runs per library in the order torch, shoal, shoal, torch, ... The table
gives the median and p90 step time over all timed steps (after warm-up), the median time to set
up (init_rpc, the RemoteModules and the optimizer) and the ratio shoal/torch (below 1: shoal is
faster), then what the timed steps cost besides time: the CPU of every thread of the three workers,
and each worker's minor page faults (getrusage before and after). Every run starts from the same
seeds, so their losses and final parameters must agree; the last line says whether they did (and
the exit status is 1 if not).

`--breakdown` also times the parts of a step, alike for both libraries: tensor hooks on "ps" and
"mlp" note (perf_counter, one clock for every process on the host) when each worker's backward
pass starts (its output's gradient is in) and ends (its input's gradient, or the embedding's
weight's, is computed), and the trainer notes when the forward, backward and optimizer step end.
The hooks cost a little, so those runs' step times are not the plain ones.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `tests` importable
from tests.ranks import run_ranks

LIBRARIES = {"torch": "torch.distributed (TensorPipe)", "shoal": "shoal"}  # name: column heading
WORKERS = ("trainer", "ps", "mlp")
NUM_EMBEDDINGS, EMBEDDING_DIM, HIDDEN, CLASSES = 100_000, 64, 256, 10
BATCH, BAG = 128, 16  # bags per batch, indices per bag
DISTINCT_BATCHES = 8  # cycled through
WARMUP = 10
LR = 0.05
RPC_TIMEOUT = 60.0  # seconds, any one RPC
NUM_WORKER_THREADS = 16  # TensorPipe's default


# ---- the model, built on the worker that holds each part (seeded, so both runs start alike) ---------------------

def _embedding():
    import torch
    from torch import nn

    torch.manual_seed(1)
    return nn.EmbeddingBag(NUM_EMBEDDINGS, EMBEDDING_DIM, mode="sum")


def _mlp():
    import torch
    from torch import nn

    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(EMBEDDING_DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU())


def _head():
    import torch
    from torch import nn

    torch.manual_seed(3)
    return nn.Linear(HIDDEN, CLASSES)


# ---- where a step's time goes (--breakdown) ---------------------------------------------------------------------

_STAMPS: list[tuple[str, float]] = []  # on "ps" and "mlp": (event, when), in the order they happened


def _stamp(event: str) -> None:
    _STAMPS.append((event, time.perf_counter()))


def _take_stamps() -> list[tuple[str, float]]:
    taken = list(_STAMPS)
    _STAMPS.clear()
    return taken


def _stamping(module, worker: str):
    """`module`, noting when its backward pass starts (its output's gradient is in) and when it ends
    with the gradient it sends on (its input's, where that requires grad). Both libraries'
    RemoteModules call `forward` itself, so the hooks go on tensors, not on the module."""
    forward = module.forward

    def stamped_forward(*args):
        for arg in args:
            if arg.requires_grad:
                arg.register_hook(lambda _: _stamp(f"{worker} end"))
        output = forward(*args)
        output.register_hook(lambda _: _stamp(f"{worker} start"))
        return output
    module.forward = stamped_forward
    return module


def _stamped_embedding():
    module = _embedding()
    module.weight.register_hook(lambda _: _stamp("ps end"))  # its input needs no gradient: it ends with its weight's
    return _stamping(module, "ps")


def _stamped_mlp():
    return _stamping(_mlp(), "mlp")


SEGMENTS = {  # name: (from, to), events on the trainer ("forward", ...) and on the workers' passes
    "forward: embedding on ps, MLP on mlp, head": ("begin", "forward"),
    "backward: the trainer's pass, gradient to mlp": ("forward", "mlp start"),
    "backward: mlp's pass": ("mlp start", "mlp end"),
    "backward: gradient from mlp to ps": ("mlp end", "ps start"),
    "backward: ps's pass": ("ps start", "ps end"),
    "backward: from ps's gradient to the trainer's return": ("ps end", "backward"),
    "optimizer step": ("backward", "step"),
}


def _segments(trainer: list[dict[str, float]], workers: list[tuple[str, float]]) -> dict[str, float]:
    """Median seconds per segment over the timed steps, from the trainer's per-step times and the
    workers' stamps (one of each event per step)."""
    events: dict[str, list[float]] = {}
    for event, when in workers:
        events.setdefault(event, []).append(when)
    for event, whens in events.items():
        if len(whens) != len(trainer):
            raise RuntimeError(f"--breakdown: {len(whens)} {event!r} stamps for {len(trainer)} steps")
    steps = [{**times, **{event: whens[i] for event, whens in events.items()}} for i, times in enumerate(trainer)]
    return {name: statistics.median(step[end] - step[begin] for step in steps)
            for name, (begin, end) in SEGMENTS.items()}


def _usage() -> tuple[float, int]:
    """This process's CPU seconds (user and system, every thread) and minor page faults so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt


def _usage_per_step(before: dict[str, tuple[float, int]], after: dict[str, tuple[float, int]],
                    steps: int) -> dict[str, tuple[float, float]]:
    """Per worker: (CPU seconds, minor page faults) per timed step."""
    return {worker: ((after[worker][0] - before[worker][0]) / steps, (after[worker][1] - before[worker][1]) / steps)
            for worker in WORKERS}


def _batches():
    import torch

    generator = torch.Generator().manual_seed(4)
    return [(torch.randint(0, NUM_EMBEDDINGS, (BATCH * BAG,), generator=generator),
             torch.arange(0, BATCH * BAG, BAG),
             torch.randint(0, CLASSES, (BATCH,), generator=generator)) for _ in range(DISTINCT_BATCHES)]


def _fingerprint(module_rref) -> list[float]:
    """Run on a module's owner: per parameter, its sum and a position-weighted sum (float64)."""
    import torch

    out = []
    for param in module_rref.local_value().parameters():
        flat = param.detach().flatten().double()
        out += [flat.sum().item(), (flat * torch.linspace(-1, 1, flat.numel(), dtype=torch.float64)).sum().item()]
    return out


# ---- one program, two module sets -------------------------------------------------------------------------------

def _library(name: str) -> SimpleNamespace:
    """The four modules the program uses, under torch.distributed's names."""
    if name == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
        from torch.distributed.nn import RemoteModule
        from torch.distributed.optim import DistributedOptimizer
    else:
        from shoal import autograd as dist_autograd
        from shoal import rpc
        from shoal.nn import RemoteModule
        from shoal.optim import DistributedOptimizer
    return SimpleNamespace(rpc=rpc, dist_autograd=dist_autograd, DistributedOptimizer=DistributedOptimizer,
                           RemoteModule=RemoteModule)


def _train(lib: SimpleNamespace, steps: int, started: float, breakdown: bool) -> dict:
    """On the trainer: build the model and optimizer, run WARMUP + `steps` steps timing each (and
    their parts, with `breakdown`)."""
    import torch
    from torch.nn import functional

    embedding = lib.RemoteModule("ps/cpu", _stamped_embedding if breakdown else _embedding)
    mlp = lib.RemoteModule("mlp/cpu", _stamped_mlp if breakdown else _mlp)
    head = _head()
    params = [*embedding.remote_parameters(), *mlp.remote_parameters(), *(lib.rpc.RRef(p) for p in head.parameters())]
    optimizer = lib.DistributedOptimizer(torch.optim.SGD, params, lr=LR)
    setup = time.perf_counter() - started
    batches = _batches()
    times, losses, parts = [], [], []

    def usage() -> dict[str, tuple[float, int]]:
        return {"trainer": _usage(), **{worker: lib.rpc.rpc_sync(worker, _usage) for worker in ("ps", "mlp")}}

    for i in range(WARMUP + steps):
        if i == WARMUP:
            if breakdown:
                for worker in ("ps", "mlp"):
                    lib.rpc.rpc_sync(worker, _take_stamps)
            before = usage()
        indices, offsets, target = batches[i % len(batches)]
        start = time.perf_counter()
        with lib.dist_autograd.context() as context_id:
            loss = functional.cross_entropy(head(mlp(embedding(indices, offsets))), target)
            forward = time.perf_counter()
            lib.dist_autograd.backward(context_id, [loss])
            backward = time.perf_counter()
            optimizer.step(context_id)
            step = time.perf_counter()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        parts.append({"begin": start, "forward": forward, "backward": backward, "step": step})
    per_step = _usage_per_step(before, usage(), steps)
    fingerprint = [*lib.rpc.rpc_sync("ps", _fingerprint, args=(embedding.get_module_rref(),)),
                   *lib.rpc.rpc_sync("mlp", _fingerprint, args=(mlp.get_module_rref(),)),
                   *_fingerprint(lib.rpc.RRef(head))]
    segments = None
    if breakdown:
        stamps = [stamp for worker in ("ps", "mlp") for stamp in lib.rpc.rpc_sync(worker, _take_stamps)]
        segments = _segments(parts[WARMUP:], stamps)
    return {"times": times[WARMUP:], "losses": losses, "fingerprint": fingerprint, "setup": setup, "segments": segments,
            "usage": per_step}


def _drop_torchscript_notice() -> None:
    """torch's DistributedOptimizer warns on every owner that its TorchScript path is deprecated,
    under `simplefilter("always")`, which no filter can silence: drop that one notice when shown."""
    show = warnings.showwarning

    def showwarning(message, category, *args, **kwargs) -> None:
        if "`TorchScript` support for functional optimizers" not in str(message):
            show(message, category, *args, **kwargs)

    warnings.showwarning = showwarning


def _worker(rank: int, world_size: int, port: int, library: str, steps: int, breakdown: bool) -> dict | None:
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)  # torch.distributed.rpc's deprecation notices
    _drop_torchscript_notice()
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    lib = _library(library)
    started = time.perf_counter()
    options = lib.rpc.TensorPipeRpcBackendOptions(num_worker_threads=NUM_WORKER_THREADS, rpc_timeout=RPC_TIMEOUT,
                                                  init_method=f"tcp://127.0.0.1:{port}")
    lib.rpc.init_rpc(WORKERS[rank], rank=rank, world_size=world_size, rpc_backend_options=options)
    try:
        return _train(lib, steps, started, breakdown) if rank == 0 else None  # the trainer's result
    finally:
        lib.rpc.shutdown()


def run_side(library: str, steps: int, timeout: float, breakdown: bool = False) -> dict:
    """Run the program with one library's modules on len(WORKERS) fresh spawned processes; the
    trainer's result. Raises if a worker fails or the whole run takes longer than `timeout` seconds."""
    return run_ranks(_worker, len(WORKERS), library, steps, breakdown, backend=None, timeout=timeout)[0]


def _p90(times: list[float]) -> float:
    return statistics.quantiles(times, n=10)[-1] if len(times) > 1 else times[0]


def agreement(result: dict[str, list[dict]]) -> tuple[bool, float]:
    """Whether every run computed the same losses and final parameters as the first torch run, and
    the largest relative difference from it."""
    reference = result["torch"][0]
    expected = reference["losses"] + reference["fingerprint"]
    worst = 0.0
    for runs in result.values():
        for one in runs:
            got = one["losses"] + one["fingerprint"]
            if len(got) != len(expected):
                return False, math.inf
            worst = max([worst, *(abs(x - y) / max(abs(x), abs(y), 1e-3) for x, y in zip(got, expected, strict=True))])
    return worst <= 1e-4, worst


def table(result: dict[str, list[dict]]) -> list[str]:
    times = {library: [t for one in runs for t in one["times"]] for library, runs in result.items()}
    runs = len(result["shoal"])
    over = f"{len(times['shoal'])} steps" + (f" ({runs} runs each)" if runs > 1 else "")
    lines = [f"| measure | {LIBRARIES['torch']} | {LIBRARIES['shoal']} | ratio shoal/torch |", "|---|---|---|---|"]
    for label, stat in ((f"step time, median of {over}", statistics.median), ("step time, p90", _p90)):
        t, s = stat(times["torch"]), stat(times["shoal"])
        lines.append(f"| {label} | {t * 1e3:.2f} ms | {s * 1e3:.2f} ms | {s / t:.2f}x time |")
    if runs > 1:  # this VM's speed drifts between runs: each round's two runs, taken in turn, drift least
        ratios = [statistics.median(shoal_run["times"]) / statistics.median(torch_run["times"])
                  for torch_run, shoal_run in zip(result["torch"], result["shoal"], strict=True)]
        lines.append(f"| step time, median of the {runs} rounds' ratios (each run's median) | | | "
                     f"{statistics.median(ratios):.2f}x time ({min(ratios):.2f}-{max(ratios):.2f}x) |")
    t, s = (statistics.median(one["setup"] for one in result[library]) for library in ("torch", "shoal"))
    lines.append(f"| setup: init_rpc, RemoteModules, DistributedOptimizer | {t:.2f} s | {s:.2f} s | "
                 f"{s / t:.2f}x time |")
    t, s = (statistics.median(sum(one["usage"][w][0] for w in WORKERS) for one in result[library])
            for library in ("torch", "shoal"))
    lines.append(f"| CPU per step, every thread of {' + '.join(WORKERS)} (median of runs) | {t * 1e3:.2f} ms | "
                 f"{s * 1e3:.2f} ms | {s / t:.2f}x CPU |")
    faults = {library: ", ".join(f"{statistics.median(one['usage'][w][1] for one in runs):.0f}" for w in WORKERS)
              for library, runs in result.items()}
    lines.append(f"| minor page faults per step, {', '.join(WORKERS)} (median of runs) | {faults['torch']} | "
                 f"{faults['shoal']} | |")
    if result["shoal"][0]["segments"] is not None:
        lines += ["", f"| part of a step (median of each run's median, hooks on) | {LIBRARIES['torch']} | "
                      f"{LIBRARIES['shoal']} | shoal - torch |", "|---|---|---|---|"]
        for name in SEGMENTS:
            t, s = (statistics.median(one["segments"][name] for one in result[library])
                    for library in ("torch", "shoal"))
            lines.append(f"| {name} | {t * 1e3:.3f} ms | {s * 1e3:.3f} ms | {(s - t) * 1e3:+.3f} ms |")
    same, worst = agreement(result)
    final = {library: runs[0]["losses"][-1] for library, runs in result.items()}
    lines += ["", f"Same computation (the loss of every step and the final parameters, same seeds, every run): "
                  f"{'yes' if same else 'NO'} (largest relative difference {worst:.1e}); final loss torch "
                  f"{final['torch']:.6f}, shoal {final['shoal']:.6f}."]
    return lines


def run(steps: int, rounds: int, timeout: float, breakdown: bool = False) -> dict[str, list[dict]]:
    """`rounds` runs per library, in the order torch, shoal, shoal, torch, torch, ... so that a
    machine getting busier or quieter meanwhile favours neither."""
    result: dict[str, list[dict]] = {library: [] for library in LIBRARIES}
    for i in range(rounds):
        for library in (LIBRARIES if i % 2 == 0 else reversed(LIBRARIES)):
            result[library].append(run_side(library, steps, timeout, breakdown))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200,
                        help=f"timed steps per run, after {WARMUP} warm-up steps (median and p90 reported)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per library, alternating (fresh processes each)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    parser.add_argument("--markdown", help="also append the table to this file")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the parts of a step (forward, each worker's backward pass and what lies "
                             "between them, optimizer step) through tensor hooks, in both libraries")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    result = run(args.steps, args.rounds, args.timeout, args.breakdown)
    lines = table(result)
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n".join(lines) + "\n")
    if not agreement(result)[0]:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
