"""Healing benchmark: all-reduces on 3 ranks while connections are reset under them.

    shoal bench faults                  # or: python benchmarks/faults.py
    shoal bench faults --resets 50      # fewer resets

Each of `--resets` all-reduces (16 MiB and 64 MiB, float32, alternating) has one connection, chosen at
random, reset at a random moment while it runs; every result is checked against the exact sum. The
same number of all-reduces without resets, interleaved with them, gives the baseline; the difference
in median and mean time is what one heal costs. Run it with SHOAL_SHM=0 too: then a replay resends
payload bytes, not only headers of frames in shared-memory slots. (torch's gloo and NCCL have no
counterpart: a reset connection ends their job.)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `tests` importable
from tests.ranks import run_ranks

WORLD = 3
SIZES = (16 << 20, 64 << 20)


def _worker(rank: int, world_size: int, port: int, resets: int) -> dict:
    import torch

    import shoal.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("shoal", f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    transport = dist.default_group().transport
    rng = random.Random(rank)
    times: dict[bool, list[float]] = {False: [], True: []}
    wrong = 0
    for i in range(2 * resets):
        faulty = i % 2 == 1  # interleaved, so that both kinds see the same machine
        numel = SIZES[(i // 2) % len(SIZES)] // 4
        tensor = torch.full((numel,), float(rank + 1))
        timer = None
        if faulty and rank == 0:  # rank 0 resets one of its two links somewhere inside the op
            peer = rng.choice([1, 2])
            timer = threading.Timer(rng.uniform(0.0, 0.02 * numel * 4 / (16 << 20)), transport.sever, (peer,))
        dist.barrier()
        start = time.perf_counter()
        if timer is not None:
            timer.start()
        dist.all_reduce(tensor)
        elapsed = time.perf_counter() - start
        if timer is not None:
            timer.join()
        wrong += int(not torch.all(tensor == WORLD * (WORLD + 1) / 2).item())
        times[faulty].append(elapsed)
    slowest = torch.tensor([statistics.median(times[False]), statistics.median(times[True]),
                            statistics.fmean(times[False]), statistics.fmean(times[True]), wrong], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    # The same on every rank: the slowest rank's figures.
    return {"median": slowest[:2].tolist(), "mean": slowest[2:4].tolist(), "wrong": int(slowest[4].item()),
            "resets": resets}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resets", type=int, default=200)
    args = parser.parse_args(argv)
    out = run_ranks(_worker, WORLD, args.resets, backend=None, timeout=None)[0]
    print(f"{out['resets']} all-reduces (16/64 MiB, {WORLD} ranks) each with one connection reset: "
          f"{out['wrong']} wrong results")
    for stat in ("median", "mean"):
        clean, reset = out[stat]
        print(f"{stat} time per all-reduce: {clean * 1e3:.1f} ms without resets, {reset * 1e3:.1f} ms with one: "
              f"a heal costs {(reset - clean) * 1e3:+.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
