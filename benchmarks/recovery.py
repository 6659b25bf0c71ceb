"""Checkpoint and recovery benchmark.

    python benchmarks/recovery.py             # or: shoal bench recovery [--trials 10]

1. How long `save` blocks training for a model of about 100 MB: torch.save, CheckpointManager
   synchronous (serialize, write, fsync, rename, manifest), and asynchronous (the snapshot only;
   the write goes on in the background).
2. Restart recovery: a 2-worker DDP job (benchmarks/recovery_job.py) whose rank 1 SIGKILLs itself
   mid-training, once per trial, under `shoal run --max-restarts 1` (shoal DDP) and under torchrun
   (torch DDP, gloo). Reported: the share of trials that finish, and the median time from the
   worker's death to the first step completed after the restart.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

JOB = Path(__file__).resolve().parent / "recovery_job.py"


def save_blocking(repeats: int = 3) -> dict[str, float]:
    from shoal.checkpoint import CheckpointManager

    model = nn.Sequential(*[nn.Linear(2500, 2500) for _ in range(4)])  # 25M float32 = 100 MB
    state = {"model": model.state_dict()}
    times: dict[str, list[float]] = {"torch.save": [], "shoal sync": [], "shoal async (blocking part)": [],
                                     "shoal async (background write)": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            start = time.perf_counter()
            torch.save(state, Path(tmp) / f"plain-{i}.pt")
            times["torch.save"].append(time.perf_counter() - start)
            sync = CheckpointManager(Path(tmp) / "sync", keep=1, rank=0)
            start = time.perf_counter()
            sync.save(i, state)
            times["shoal sync"].append(time.perf_counter() - start)
            background = CheckpointManager(Path(tmp) / "async", keep=1, async_save=True, rank=0)
            start = time.perf_counter()
            background.save(i, state)
            times["shoal async (blocking part)"].append(time.perf_counter() - start)
            background.wait()
            times["shoal async (background write)"].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def _launchers(impl: str, ckpt: Path) -> list[str]:
    job = [str(JOB), "--impl", impl, "--dir", str(ckpt)]
    if impl == "shoal":
        return [sys.executable, "-m", "shoal.run", "--nproc-per-node", "2", "--max-restarts", "1", *job]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1", *job]


def trial(impl: str, timeout: float) -> float | None:
    """Seconds from the death to the first step after restart; None if the job did not finish."""
    with tempfile.TemporaryDirectory() as tmp:
        # A session of its own, so that a hung job's workers can be stopped with their launcher.
        job = subprocess.Popen(_launchers(impl, Path(tmp)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
        try:
            out, _ = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
            return None
    if job.returncode != 0:
        return None
    # torchrun does not prefix its workers' lines, so two ranks' output may run together on one line.
    death = float(re.search(r"death (\d+\.\d{6})", out).group(1))
    after = [float(t) for t in re.findall(r"step 21 (\d+\.\d{6})", out) if float(t) > death]
    return min(after) - death if after else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=60, help="seconds after which a trial counts as failed")
    parser.add_argument("--only", choices=["save", "shoal", "torch"], help="run one part only")
    args = parser.parse_args(argv)
    if args.only in (None, "save"):
        print("| save of a 100 MB model | time |\n|---|---|")
        for name, seconds in save_blocking().items():
            print(f"| {name} | {seconds * 1e3:,.0f} ms |")
    print("\n| launcher | recovered | median death-to-first-step | all recoveries |\n|---|---|---|---|")
    for impl, label in (("shoal", "shoal run (shoal DDP)"), ("torch", "torchrun (torch DDP, gloo)")):
        if args.only not in (None, impl):
            continue
        results = [trial(impl, args.timeout) for _ in range(args.trials)]
        ok = [r for r in results if r is not None]
        median = f"{statistics.median(ok):.2f} s" if ok else "-"
        print(f"| {label} | {len(ok)} of {len(results)} | {median} | {', '.join(f'{r:.1f}' for r in ok)} |",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
