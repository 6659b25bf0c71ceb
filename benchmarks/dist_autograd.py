"""Distributed autograd benchmark: model-parallel training over RPC with shoal's rpc, autograd,
optim.DistributedOptimizer and nn.RemoteModule beside torch.distributed's (TensorPipe), as one program.

    python benchmarks/dist_autograd.py                # or: shoal bench autograd [--steps 150]
    shoal bench autograd --steps 20 --markdown docs/x.md

Three workers: "ps" holds an nn.EmbeddingBag (100k x 64) as a RemoteModule, "mlp" holds two
Linear+ReLU layers as another, and the "trainer" holds the final Linear. One step, on the trainer:

    with dist_autograd.context() as ctx:
        loss = cross_entropy(head(mlp(embedding(indices, offsets))), target)    # two RPCs
        dist_autograd.backward(ctx, [loss])                   # gradients cross back trainer->mlp->trainer->ps
        optimizer.step(ctx)                                   # DistributedOptimizer(SGD) on all three

The same code runs twice, each time in three freshly spawned processes: once with torch's modules,
once with shoal's. The table gives the median and p90 step time after warm-up (and the time to set
up: init_rpc, the RemoteModules and the optimizer) and the ratio shoal/torch (below 1: shoal is
faster). Both runs start from the same seeds, so their losses and final parameters must agree;
the last line says whether they did.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks` importable
from benchmarks import _ranks

LIBRARIES = {"torch": "torch.distributed (TensorPipe)", "shoal": "shoal"}
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


def _train(lib: SimpleNamespace, steps: int, started: float) -> dict:
    """On the trainer: build the model and optimizer, run WARMUP + `steps` steps timing each."""
    import torch
    from torch.nn import functional

    embedding = lib.RemoteModule("ps/cpu", _embedding)
    mlp = lib.RemoteModule("mlp/cpu", _mlp)
    head = _head()
    params = [*embedding.remote_parameters(), *mlp.remote_parameters(), *(lib.rpc.RRef(p) for p in head.parameters())]
    optimizer = lib.DistributedOptimizer(torch.optim.SGD, params, lr=LR)
    setup = time.perf_counter() - started
    batches = _batches()
    times, losses = [], []
    for i in range(WARMUP + steps):
        indices, offsets, target = batches[i % len(batches)]
        start = time.perf_counter()
        with lib.dist_autograd.context() as context_id:
            loss = functional.cross_entropy(head(mlp(embedding(indices, offsets))), target)
            lib.dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    fingerprint = [*lib.rpc.rpc_sync("ps", _fingerprint, args=(embedding.get_module_rref(),)),
                   *lib.rpc.rpc_sync("mlp", _fingerprint, args=(mlp.get_module_rref(),)),
                   *_fingerprint(lib.rpc.RRef(head))]
    return {"times": times[WARMUP:], "losses": losses, "fingerprint": fingerprint, "setup": setup}


def _worker(rank: int, library: str, port: int, steps: int, results) -> None:
    import torch

    started = time.perf_counter()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)  # torch.distributed.rpc's deprecation notices
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    lib = _library(library)
    options = lib.rpc.TensorPipeRpcBackendOptions(num_worker_threads=NUM_WORKER_THREADS, rpc_timeout=RPC_TIMEOUT,
                                                  init_method=f"tcp://127.0.0.1:{port}")
    lib.rpc.init_rpc(WORKERS[rank], rank=rank, world_size=len(WORKERS), rpc_backend_options=options)
    try:
        if rank == 0:
            results.put(_train(lib, steps, started))
    finally:
        lib.rpc.shutdown()


def run_side(library: str, steps: int, timeout: float) -> dict:
    """Run the program with one library's modules on len(WORKERS) fresh spawned processes; the
    trainer's result. Raises if a worker fails or the whole run takes longer than `timeout` seconds;
    every process started here is gone when it returns."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _ranks.free_port()
    procs = [ctx.Process(target=_worker, args=(rank, library, port, steps, results), daemon=True,
                         name=f"{library}-{name}") for rank, name in enumerate(WORKERS)]
    deadline = time.monotonic() + timeout
    for p in procs:
        p.start()
    try:
        while True:
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                failed = [p for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"{library} run: worker {failed[0].name} exited with code "
                                       f"{failed[0].exitcode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{library} run: no result after {timeout:.0f} s") from None
    finally:
        for p in procs:  # a graceful RPC shutdown first; then the hard way
            p.join(timeout=30)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        results.join_thread()


def _p90(times: list[float]) -> float:
    return statistics.quantiles(times, n=10)[-1] if len(times) > 1 else times[0]


def agreement(result: dict[str, dict]) -> tuple[bool, float]:
    """Whether the two runs computed the same losses and final parameters, and the largest
    relative difference between them."""
    ours, theirs = result["shoal"], result["torch"]
    a = ours["losses"] + ours["fingerprint"]
    b = theirs["losses"] + theirs["fingerprint"]
    if len(a) != len(b):
        return False, math.inf
    worst = max((abs(x - y) / max(abs(x), abs(y), 1e-3) for x, y in zip(a, b, strict=True)), default=0.0)
    return worst <= 1e-4, worst


def table(result: dict[str, dict]) -> list[str]:
    ours, theirs = result["shoal"], result["torch"]
    steps = len(ours["times"])
    rows = [(f"step time, median of {steps}", statistics.median), ("step time, p90", _p90)]
    lines = ["| measure | torch.distributed (TensorPipe) | shoal | ratio shoal/torch |", "|---|---|---|---|"]
    for label, stat in rows:
        t, s = stat(theirs["times"]), stat(ours["times"])
        lines.append(f"| {label} | {t * 1e3:.2f} ms | {s * 1e3:.2f} ms | {s / t:.2f}x time |")
    t, s = theirs["setup"], ours["setup"]
    lines.append(f"| setup: init_rpc, RemoteModules, DistributedOptimizer | {t:.2f} s | {s:.2f} s | "
                 f"{s / t:.2f}x time |")
    same, worst = agreement(result)
    lines += ["", f"Same computation (losses of all {len(ours['losses'])} steps and final parameters, "
                  f"same seeds): {'yes' if same else 'NO'} (largest relative difference {worst:.1e}); "
                  f"final loss torch {theirs['losses'][-1]:.6f}, shoal {ours['losses'][-1]:.6f}."]
    return lines


def run(steps: int, timeout: float) -> dict[str, dict]:
    return {library: run_side(library, steps, timeout) for library in LIBRARIES}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help=f"timed steps per library, after {WARMUP} warm-up")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each library's run may take")
    parser.add_argument("--markdown", help="also append the table to this file")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    result = run(args.steps, args.timeout)
    lines = table(result)
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n".join(lines) + "\n")
    if not agreement(result)[0]:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
