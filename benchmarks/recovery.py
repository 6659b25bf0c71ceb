"""Checkpoint and recovery benchmark.

    python benchmarks/recovery.py             # or: shoal bench recovery [--trials 10]

1. How long `save` blocks training for a model of about 100 MB: torch.save, CheckpointManager
   synchronous (serialize, write, fsync, rename, manifest), and asynchronous (the snapshot only;
   the write goes on in the background).
2. Recovery: a DDP job (benchmarks/recovery_job.py) whose rank 1 SIGKILLs itself mid-training, once
   per trial: with live recovery under `shoal run --live` (3 workers; the other two go on; also with the
   model under fully_shard, the survivors re-sharding it from the lost worker's buddy), and
   restarted under `shoal run --max-restarts 1` (shoal DDP) and under torchrun (torch DDP, gloo), 2
   workers each. Reported: the share of trials that finish, and the median time from the worker's
   death to the first step completed after it (after the restart, or taken again live).
3. Losing the node that serves the store (root: two hosts from network namespaces, tests/hosts.py):
   `--nnodes 1:2` with 2 workers on each host; host 0's launcher, whose replica is the store's
   primary, is SIGKILLed at a random step with its workers; reported: from the death to host 1's
   workers committing the lost step, with host 1's replica as the primary.
4. A joiner catching up: live recovery with `--max-restarts 1` and min_workers 3, so the survivors
   wait for the worker the launcher starts in the lost one's place. Reported: from the death to the
   new worker being ready to join (process start, imports, building the model and data), and from
   then to its first committed step (admission at a step boundary, the new group, the parameters
   and state from rank 0, the step itself).
"""

from __future__ import annotations

import argparse
import os
import random
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `tests` importable
from tests.hosts import TwoHosts, namespaces_missing

JOB = Path(__file__).resolve().parent / "recovery_job.py"
_HOSTS_ENV = {"SHOAL_SECRET": "store-failover-benchmark", "SHOAL_SHM": "0"}  # the hosts share no memory


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


def _launchers(impl: str, ckpt: Path, kill_at: int, hidden: int) -> list[str]:
    if impl in ("live", "live-shard"):  # three workers, so that two go on together
        return [sys.executable, "-m", "shoal.run", "--live", "--nproc-per-node", "3", str(JOB), "--impl", "live",
                "--kill-at", str(kill_at), "--hidden", str(hidden), *["--shard"] * (impl == "live-shard")]
    if impl == "rejoin":
        return [sys.executable, "-m", "shoal.run", "--live", "--max-restarts", "1", "--nproc-per-node", "3", str(JOB),
                "--impl", "live", "--kill-at", str(kill_at), "--min-workers", "3"]
    job = [str(JOB), "--impl", impl, "--dir", str(ckpt)]
    if impl == "shoal":
        return [sys.executable, "-m", "shoal.run", "--nproc-per-node", "2", "--max-restarts", "1", *job]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1", *job]


def _run(impl: str, kill_at: int, timeout: float, hidden: int = 256) -> str | None:
    """The job's output, or None if it did not finish."""
    with tempfile.TemporaryDirectory() as tmp:
        # A session of its own, so that a hung job's workers can be stopped with their launcher.
        job = subprocess.Popen(_launchers(impl, Path(tmp), kill_at, hidden), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, _ = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
            return None
    return out if job.returncode == 0 else None


def trial(impl: str, timeout: float, hidden: int) -> float | None:
    """Seconds from the death to the first step completed after it; None if the job did not finish."""
    # Live recovery takes the lost step again, so its kill can fall on any step; restarts resume from
    # the checkpoint of step 20 and take steps 21 to 25 again: the first measured is 21.
    kill_at = random.randint(1, 38) if impl.startswith("live") else 25
    if (out := _run(impl, kill_at, timeout, hidden)) is None:
        return None
    # torchrun does not prefix its workers' lines, so two ranks' output may run together on one line.
    death = float(re.search(r"death (\d+\.\d{6})", out).group(1))
    first = kill_at + 1 if impl.startswith("live") else 21
    after = [float(t) for t in re.findall(rf"step {first} (\d+\.\d{{6}})", out) if float(t) > death]
    return min(after) - death if after else None


def store_failover_trial(timeout: float) -> float | None:
    """Seconds from the loss of host 0 (its launcher, the store's primary, and its two workers) to host 1's
    workers committing the step lost; None if host 1's job did not finish."""
    kill_at = random.randint(1, 38)
    hosts = TwoHosts.build()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            outs = [Path(tmp) / f"host{h}.out" for h in (0, 1)]
            command = ["-m", "shoal.run", "--nnodes", "1:2", "--nproc-per-node", "2", "--live", "--rdzv-endpoint",
                       f"{hosts.addresses[0]}:29500", str(JOB), "--impl", "live", "--kill-at", str(kill_at),
                       "--kill-launcher", "--death-file", f"{tmp}/death"]
            nodes = []
            for host, out in enumerate(outs):
                with out.open("w") as sink:
                    nodes.append(hosts.start(host, command, _HOSTS_ENV, stderr=subprocess.STDOUT, stdout=sink))
            try:
                finished = nodes[1].wait(timeout=timeout) == 0
            except subprocess.TimeoutExpired:
                finished = False
            for node in nodes:
                if node.poll() is None:
                    node.kill()
                    node.wait()
            if not finished:
                print(f"store failover (kill at step {kill_at}): host 1's job did not finish; its output ends:\n"
                      + "\n".join(outs[1].read_text().splitlines()[-15:]), file=sys.stderr)
                return None
            death = float(re.search(r"death (\d+\.\d{6})", (Path(tmp) / "death").read_text()).group(1))
            after = [float(t) for t in re.findall(rf"step {kill_at + 1} (\d+\.\d{{6}})", outs[1].read_text())]
            if not after:
                print(f"store failover (kill at step {kill_at}): host 1 never committed step {kill_at + 1}",
                      file=sys.stderr)
            return min(after) - death if after else None
    finally:
        hosts.tear_down()


def joiner_trial(timeout: float) -> tuple[float, float] | None:
    """Seconds from the death to the joiner being ready to join, and from then to its first committed
    step; None if the job did not finish."""
    if (out := _run("rejoin", random.randint(1, 38), timeout)) is None:
        return None
    death = float(re.search(r"death (\d+\.\d{6})", out).group(1))
    joiner = out[out.index("[rank1]: ready "):]
    ready = float(re.search(r"ready (\d+\.\d{6})", joiner).group(1))
    first = float(re.search(r"\[rank1\]: step \d+ (\d+\.\d{6})", joiner).group(1))
    return ready - death, first - ready


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=60, help="seconds after which a trial counts as failed")
    parser.add_argument("--only", choices=["save", "live", "live-shard", "store-failover", "shoal", "torch", "rejoin"],
                        help="run one part only")
    parser.add_argument("--hidden", type=int, default=256, help="live recovery: the model's hidden width (64 x it "
                                                                  "+ it x 10 weights)")
    args = parser.parse_args(argv)
    if args.only in (None, "save"):
        print("| save of a 100 MB model | time |\n|---|---|")
        for name, seconds in save_blocking().items():
            print(f"| {name} | {seconds * 1e3:,.0f} ms |")
    if args.only in (None, "live", "live-shard", "shoal", "torch"):
        print("\n| launcher | recovered | median death-to-first-step | all recoveries |\n|---|---|---|---|")
    for impl, label in (("live", "shoal run --live (live recovery, 3 workers)"),
                        ("live-shard", "shoal run --live, fully_shard (each block held by a buddy, 3 workers)"),
                        ("shoal", "shoal run (shoal DDP)"),
                        ("torch", "torchrun (torch DDP, gloo)")):
        if args.only not in (None, impl):
            continue
        results = [trial(impl, args.timeout, args.hidden) for _ in range(args.trials)]
        ok = [r for r in results if r is not None]
        median = f"{statistics.median(ok):.2f} s" if ok else "-"
        print(f"| {label} | {len(ok)} of {len(results)} | {median} | {', '.join(f'{r:.2f}' for r in ok)} |",
              flush=True)
    if args.only in (None, "store-failover"):
        if (missing := namespaces_missing()) is not None:
            print(f"\nstore failover: skipped ({missing})")
        else:
            results = [store_failover_trial(args.timeout) for _ in range(args.trials)]
            ok = [r for r in results if r is not None]
            median = f"{statistics.median(ok):.2f} s" if ok else "-"
            print("\n| lost node | recovered | median death-to-first-step | all recoveries |\n|---|---|---|---|\n"
                  f"| shoal run --live --nnodes 1:2, 2 hosts x 2 workers: host 0 (the store's primary) | "
                  f"{len(ok)} of {len(results)} | {median} | {', '.join(f'{r:.2f}' for r in ok)} |", flush=True)
    if args.only in (None, "rejoin"):
        joins = [joiner_trial(args.timeout) for _ in range(args.trials)]
        ok = [j for j in joins if j is not None]
        print("\n| joiner (shoal run --live --max-restarts 1, min_workers 3) | joined | median death to ready | "
              "median ready to first committed step | slowest ready to first step |\n|---|---|---|---|---|")
        if ok:
            print(f"| 3 workers, rank 1 killed at a random step | {len(ok)} of {len(joins)} | "
                  f"{statistics.median(r for r, _ in ok):.2f} s | {statistics.median(c for _, c in ok):.2f} s | "
                  f"{max(c for _, c in ok):.2f} s |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
