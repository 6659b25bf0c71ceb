"""Recovery of a model-parallel job from a lost trainer or a lost server.

    python benchmarks/rpc_recovery.py     # or: shoal bench rpc-recovery [--trials 10] [--only shoal|shoal-server|torch]

A parameter server and three trainers (benchmarks/rpc_recovery_job.py); trainer rank 2 SIGKILLs
itself between its backward and its step, at a step drawn at random, once per trial.
- shoal (`shoal run --live`, TrainerSteps): the others go on. Reported: from the death to the step
  it died in being applied without it, and to its batch being applied by another trainer.
- shoal-server: the server dies instead, once it has applied that step; it checkpoints every 5
  steps, and the trainers make it again on trainer1 from the latest. Reported: from the death to
  the first step applied there, and to the step it died in being applied again.
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
STEPS = 40


def _run(impl: str, kill_at: int, timeout: float) -> str | None:
    """The job of `impl`, one worker killed at `kill_at`: its output, or None if it did not finish."""
    launcher = (["-m", "torch.distributed.run", "--max-restarts", "1"] if impl == "torch" else
                ["-m", "shoal.run", "--live"])
    command = [sys.executable, *launcher, "--nproc-per-node", "4", str(JOB), "--impl", impl.removesuffix("-server"),
               "--steps", str(STEPS), "--kill-at", str(kill_at)]
    with tempfile.TemporaryDirectory() as directory:
        if impl == "shoal-server":
            command += ["--victim", "server", "--checkpoint-dir", directory]
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
    if impl == "shoal":  # the step goes on without the lost trainer; its batch is taken in the next one
        first = _applied(out, death, range(kill_at, kill_at + 1))
        redone = _applied(out, death, range(kill_at + 1, STEPS))
    elif impl == "shoal-server":  # from the last checkpoint: any step first, then the one it died after
        first = _applied(out, death, range(STEPS), by="trainer1")
        redone = _applied(out, death, range(kill_at, STEPS), by="trainer1")
    else:  # the job starts again from step 0 and takes the lost step again at kill_at
        first, redone = _applied(out, death, range(1)), _applied(out, death, range(kill_at, kill_at + 1))
    if first is None or redone is None:
        return None
    return first - death, redone - death


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=120, help="seconds after which a trial counts as failed")
    parser.add_argument("--only", choices=["shoal", "shoal-server", "torch"], help="run one case only")
    args = parser.parse_args(argv)
    print("| lost worker | recovered | median death to next step applied | median death to the lost step applied | "
          "next step, every trial |\n|---|---|---|---|---|")
    for impl, label in (("shoal", "shoal run --live, TrainerSteps"),
                        ("shoal-server", "shoal run --live, the server lost, made again from its checkpoint"),
                        ("torch", "torchrun --max-restarts 1, torch.distributed.rpc")):
        if args.only not in (None, impl):
            continue
        results = [trial(impl, args.timeout) for _ in range(args.trials)]
        ok = [r for r in results if r is not None]
        first = f"{statistics.median(r[0] for r in ok):.3f} s" if ok else "-"
        redone = f"{statistics.median(r[1] for r in ok):.3f} s" if ok else "-"
        print(f"| {label} | {len(ok)} of {len(results)} | {first} | {redone} | "
              f"{', '.join(f'{r[0]:.3f}' for r in ok)} |", flush=True)


if __name__ == "__main__":
    main()
