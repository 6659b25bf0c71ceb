"""Restart recovery end to end: a worker SIGKILLed mid-training under `shoal run --max-restarts 1`
resumes from the latest checkpoint and ends with exactly the parameters of an uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _train(checkpoint_dir: Path, *worker: str) -> subprocess.CompletedProcess:
    """`worker` (the demo's, `-m shoal.demo`, or one with a fault) for 3 epochs under the launcher."""
    return subprocess.run([sys.executable, "-m", "shoal.run", "--nproc-per-node", "2", "--max-restarts", "1", *worker,
                           "--epochs", "3", "--checkpoint-every", "10", "--checkpoint-dir", str(checkpoint_dir)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)  # where -m finds tests.scripts


def _checksum(output: str) -> str:
    found = re.findall(r"final parameter checksum (\S+) after (\d+) steps", output)
    assert len(found) == 1, output[-2000:]
    return found[0]


def test_killed_worker_is_restarted_and_the_run_ends_as_if_uninterrupted(tmp_path: Path) -> None:
    clean = _train(tmp_path / "clean", "-m", "shoal.demo")
    assert clean.returncode == 0, clean.stderr[-2000:]
    crashed = _train(tmp_path / "crashed", "-m", "tests.scripts.demo_with_kill", "--kill-at", "1:25")
    assert crashed.returncode == 0, crashed.stderr[-2000:]
    assert "rank 1 failed with exit code -9" in crashed.stderr  # SIGKILL, reported as the first failure
    assert "restarting all workers" in crashed.stderr
    assert "resuming from step-0000000020.pt: step 20" in crashed.stdout
    assert _checksum(crashed.stdout) == _checksum(clean.stdout)


def _callbacks(restart_count: str) -> subprocess.CompletedProcess:
    """tests/faults.py's kill_at(1, 3) called as the demo calls it, after each step of ranks 0 and 1."""
    script = ("from tests.faults import kill_at\n"
              "on_step = kill_at(1, 3)\n"
              "for rank, step in [(0, 3), (1, 2), (1, 3), (1, 4)]:\n"
              "    on_step(rank, step)\n"
              "    print(rank, step, flush=True)\n")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=dict(os.environ, SHOAL_RESTART_COUNT=restart_count))


def test_the_injected_fault_kills_its_rank_after_its_step_in_the_first_attempt_only() -> None:
    first = _callbacks("0")
    assert (first.returncode, first.stdout.splitlines()) == (-signal.SIGKILL, ["0 3", "1 2"]), first.stderr
    restarted = _callbacks("1")
    assert (restarted.returncode, restarted.stdout.splitlines()) == (0, ["0 3", "1 2", "1 3", "1 4"]), restarted.stderr
