"""Restart recovery end to end: a worker SIGKILLed mid-training under `shoal run --max-restarts 1`
resumes from the latest checkpoint and ends with exactly the parameters of an uninterrupted run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def _train(checkpoint_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal.run", "--nproc-per-node", "2", "--max-restarts", "1",
                           "-m", "shoal.demo", "--epochs", "3", "--checkpoint-every", "10",
                           "--checkpoint-dir", str(checkpoint_dir)],
                          capture_output=True, text=True, timeout=240, env=env)


def _checksum(output: str) -> str:
    found = re.findall(r"final parameter checksum (\S+) after (\d+) steps", output)
    assert len(found) == 1, output[-2000:]
    return found[0]


def test_killed_worker_is_restarted_and_the_run_ends_as_if_uninterrupted(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SHOAL_FAULT_KILL_AT"}
    clean = _train(tmp_path / "clean", env)
    assert clean.returncode == 0, clean.stderr[-2000:]
    crashed = _train(tmp_path / "crashed", {**env, "SHOAL_FAULT_KILL_AT": "1:25"})
    assert crashed.returncode == 0, crashed.stderr[-2000:]
    assert "rank 1 failed with exit code -9" in crashed.stderr  # SIGKILL, reported as the first failure
    assert "restarting all workers" in crashed.stderr
    assert "resuming from step-0000000020.pt: step 20" in crashed.stdout
    assert _checksum(crashed.stdout) == _checksum(clean.stdout)
