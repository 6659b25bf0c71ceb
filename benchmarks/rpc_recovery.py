"""Recovery of a model-parallel job from a lost trainer or a lost server.

    python benchmarks/rpc_recovery.py     # or: shoal bench rpc-recovery [--trials 10] [--only CASE]

A parameter server and three trainers (benchmarks/rpc_recovery_job.py); trainer rank 2 SIGKILLs
itself between its backward and its step, at a step drawn at random, once per trial.
- shoal (`shoal run --live`, TrainerSteps): the others go on. Reported: from the death to the step
  it died in being applied without it, and to its batch being applied by another trainer.
- shoal-server: the server dies instead, once it has applied that step; it checkpoints every 5
  steps, and the trainers make it again on trainer1 from the latest. Reported: from the death to
  the first step applied there, and to the step it died in being applied again.
- shoal-replica: the server dies as in shoal-server, with no checkpoints but a live replica on trainer1
  (`replicas=1`), from which trainer1 makes it again: nothing that was applied is lost.
- replication-cost: no worker dies; the job with `replicas=1` and without, in turns. Reported: the
  time per step of each (median of the runs), and what the replica adds to a step.
- shoal-stage: a pipeline instead (benchmarks/stage_recovery_job.py): a driver trains three
  RemoteModule stages through LiveModules with a replica; the middle stage's worker dies in its
  forward. Reported: from the death to the first step committed after it, and to the step it died
  in committed. shoal-stage-checkpoint: the same from a checkpoint every 5 steps (no replica).
- stage-replication-cost: that pipeline without faults, through LiveModules with a replica and
  through a plain loop, in turns.
- torch (torchrun --max-restarts 1, torch.distributed.rpc): torch's RPC has no recovery; torchrun
  starts the whole job again. Reported: whether it finished, and from the death to the first step
  applied after the restart (which starts again from step 0).
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
from pathlib import Path

JOB = Path(__file__).resolve().parent / "rpc_recovery_job.py"
STAGE_JOB = Path(__file__).resolve().parent / "stage_recovery_job.py"
STEPS = 40
COST_STEPS = 200  # of the runs without faults, so that a run's start and noise weigh less


def _run(impl: str, kill_at: int, timeout: float, steps: int = STEPS) -> str | None:
    """The job of `impl`, one worker killed at `kill_at` (none if -1): its output, or None if it did not finish."""
    launcher = (["-m", "torch.distributed.run", "--max-restarts", "1"] if impl == "torch" else
                ["-m", "shoal.run", "--live"])
    job = ([str(STAGE_JOB), "--source", impl.removeprefix("shoal-stage").removeprefix("-") or "replica"]
           if impl.startswith("shoal-stage") else [str(JOB), "--impl", impl.split("-")[0]])
    command = [sys.executable, *launcher, "--nproc-per-node", "4", *job, "--steps", str(steps),
               "--kill-at", str(kill_at)]
    with tempfile.TemporaryDirectory() as directory:
        if impl == "shoal-stage-checkpoint":
            command += ["--checkpoint-dir", directory]
        elif impl == "shoal-server":
            command += ["--victim", "server", "--checkpoint-dir", directory]
        elif impl == "shoal-replica":
            command += ["--victim", "server", "--replicas", "1"]
        elif impl.startswith("shoal-replicas-"):  # no victim: the cost of replicas in a run without faults
            command += ["--replicas", impl.removeprefix("shoal-replicas-")]
        return _communicate(impl, kill_at, command, timeout)


def _communicate(impl: str, kill_at: int, command: list[str], timeout: float) -> str | None:
    """Run the job `command`: its output, or None if it failed or did not finish."""
    # A session of its own, so that a hung job's launcher can be stopped with whatever it left in it.
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.terminate()  # the launcher stops its workers, which torchrun starts in sessions of their own
        try:
            job.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
        print(f"{impl} (kill at step {kill_at}): did not finish within {timeout:g} s", file=sys.stderr)
        return None
    if job.returncode != 0:
        errors = [line for line in err.splitlines() if re.match(r"\w*(Error|Exception):", line)]
        print(f"{impl} (kill at step {kill_at}): failed with exit code {job.returncode}: {errors[-1:]}",
              file=sys.stderr)
        return None
    return out


def _applied(out: str, after: float, steps: range, by: str | None = None) -> float | None:
    """When the first of `steps` was applied after `after` (by the server on worker `by`)."""
    times = [float(t) for step, t, on in re.findall(r"applied (\d+) (\d+\.\d{6})(?: on (\w+))?", out)
             if float(t) > after and int(step) in steps and by in (None, on)]
    return min(times) if times else None


def trial(impl: str, timeout: float) -> tuple[float, float] | None:
    """(death to the next step applied, death to the lost batch applied); None if the job failed."""
    kill_at = random.randint(3, STEPS - 4)
    if (out := _run(impl, kill_at, timeout)) is None:
        return None
    death = float(re.search(r"death (\d+\.\d{6})", out).group(1))
    if impl.startswith("shoal-stage"):  # the step it died in is redone (from a checkpoint, after those before)
        first = _applied(out, death, range(STEPS))
        redone = _applied(out, death, range(kill_at, kill_at + 1))
    elif impl == "shoal":  # the step goes on without the lost trainer; its batch is taken in the next one
        first = _applied(out, death, range(kill_at, kill_at + 1))
        redone = _applied(out, death, range(kill_at + 1, STEPS))
    elif impl in ("shoal-server", "shoal-replica"):  # any step first, then the one it died after
        first = _applied(out, death, range(STEPS), by="trainer1")
        redone = _applied(out, death, range(kill_at, STEPS), by="trainer1")
    else:  # the job starts again from step 0 and takes the lost step again at kill_at
        first, redone = _applied(out, death, range(1)), _applied(out, death, range(kill_at, kill_at + 1))
    if first is None or redone is None:
        return None
    return first - death, redone - death


def step_time(impl: str, timeout: float) -> float | None:
    """Seconds per step of a run of `impl` without faults: from the first step applied to the last."""
    if (out := _run(impl, -1, timeout, COST_STEPS)) is None:
        return None
    applied: dict[int, float] = {}
    for step, t in re.findall(r"applied (\d+) (\d+\.\d{6})", out):
        applied[int(step)] = min(float(t), applied.get(int(step), float("inf")))  # its first trainer to hear
    return (applied[COST_STEPS - 1] - applied[0]) / (COST_STEPS - 1)


def replication_cost(trials: int, timeout: float, stages: bool) -> None:
    """The time per step with a replica and without, `trials` runs of each in turns: of the parameter
    server (TrainerSteps, replicas=1 or 0), or with `stages`, of the pipeline (LiveModules or none)."""
    impls = ["shoal-stage-none", "shoal-stage-replica"] if stages else ["shoal-replicas-0", "shoal-replicas-1"]
    runs: dict[str, list[float]] = {impl: [] for impl in impls}
    for _ in range(trials):
        for impl in impls:
            if (seconds := step_time(impl, timeout)) is not None:
                runs[impl].append(seconds)
    label = "shoal, LiveModules (pipeline)" if stages else "shoal, TrainerSteps"
    if not all(runs.values()):
        print(f"| {label} | - | - | - | (failed) |")
        return
    without, with_replica = (statistics.median(runs[impl]) for impl in impls)
    print(f"\n| time per step, {COST_STEPS} steps | no replica | a replica | added | every run, ms (none; one) |\n"
          f"|---|---|---|---|---|\n| {label} | {without * 1e3:.2f} ms | {with_replica * 1e3:.2f} ms | "
          f"{(with_replica / without - 1) * 100:+.1f}% | {', '.join(f'{t * 1e3:.1f}' for t in runs[impls[0]])}; "
          f"{', '.join(f'{t * 1e3:.1f}' for t in runs[impls[1]])} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=120, help="seconds after which a trial counts as failed")
    parser.add_argument("--only", choices=["shoal", "shoal-server", "shoal-replica", "shoal-stage",
                                           "shoal-stage-checkpoint", "torch", "replication-cost",
                                           "stage-replication-cost"], help="run one case only")
    args = parser.parse_args(argv)
    cases = [(impl, label) for impl, label in (
        ("shoal", "shoal run --live, TrainerSteps"),
        ("shoal-server", "shoal run --live, the server lost, made again from its checkpoint"),
        ("shoal-replica", "shoal run --live, the server lost, made again from its replica"),
        ("shoal-stage", "shoal run --live, a pipeline's middle stage lost, built again from the replica (LiveModules)"),
        ("shoal-stage-checkpoint", "shoal run --live, a pipeline's middle stage lost, built again from its checkpoint"),
        ("torch", "torchrun --max-restarts 1, torch.distributed.rpc")) if args.only in (None, impl)]
    if cases:
        print("| lost worker | recovered | median death to next step applied | median death to the lost step applied | "
              "next step, every trial |\n|---|---|---|---|---|")
    for impl, label in cases:
        results = [trial(impl, args.timeout) for _ in range(args.trials)]
        ok = [r for r in results if r is not None]
        first = f"{statistics.median(r[0] for r in ok):.3f} s" if ok else "-"
        redone = f"{statistics.median(r[1] for r in ok):.3f} s" if ok else "-"
        print(f"| {label} | {len(ok)} of {len(results)} | {first} | {redone} | "
              f"{', '.join(f'{r[0]:.3f}' for r in ok)} |", flush=True)
    if args.only in (None, "replication-cost"):
        replication_cost(args.trials, args.timeout, stages=False)
    if args.only in (None, "stage-replication-cost"):
        replication_cost(args.trials, args.timeout, stages=True)


if __name__ == "__main__":
    main()
