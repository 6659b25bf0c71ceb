"""The main job and the examples, run as a user runs them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_demo_reaches_95_percent_test_accuracy() -> None:
    result = subprocess.run([sys.executable, "-m", "shoal.cli", "demo", "--workers", "2", "--epochs", "10"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    accuracies = [float(a) for a in re.findall(r"test accuracy ([\d.]+)%", result.stdout)]
    assert len(accuracies) == 10 and accuracies[-1] >= 95.0, accuracies


def _hand_allreduce(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "shoal.run", "--nproc-per-node", "2",
                             str(ROOT / "examples" / "hand_allreduce.py"), *args],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


@pytest.mark.parametrize("backend", ["shoal", "gloo"])
def test_hand_allreduce_example_learns_and_keeps_ranks_identical(backend: str) -> None:
    result = _hand_allreduce("--backend", backend, "--epochs", "4")
    for rank in (0, 1):
        losses = [float(x) for x in re.findall(rf"Rank {rank}, epoch \d+: ([\d.]+)", result.stdout)]
        assert len(losses) == 4 and losses[-1] < losses[0] / 2, losses
    checksums = re.findall(r"Rank \d parameter checksum (\S+)", result.stdout)
    assert len(checksums) == 2 and checksums[0] == checksums[1]


def test_hand_allreduce_resumes_exactly_from_its_checkpoint(tmp_path: Path) -> None:
    straight = _hand_allreduce("--epochs", "3")
    _hand_allreduce("--epochs", "1", "--checkpoint-dir", str(tmp_path))
    resumed = _hand_allreduce("--epochs", "3", "--checkpoint-dir", str(tmp_path))
    assert "Rank 0 resuming at epoch 1" in resumed.stdout
    checksum = r"Rank 0 parameter checksum (\S+)"
    assert re.findall(checksum, resumed.stdout) == re.findall(checksum, straight.stdout)
