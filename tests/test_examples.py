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


@pytest.mark.parametrize("backend", ["shoal", "gloo"])
def test_hand_allreduce_example_learns_and_keeps_ranks_identical(backend: str) -> None:
    result = subprocess.run([sys.executable, "-m", "shoal.run", "--nproc-per-node", "2",
                             str(ROOT / "examples" / "hand_allreduce.py"), "--backend", backend, "--epochs", "4"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for rank in (0, 1):
        losses = [float(x) for x in re.findall(rf"Rank {rank}, epoch \d+: ([\d.]+)", result.stdout)]
        assert len(losses) == 4 and losses[-1] < losses[0] / 2, losses
    checksums = re.findall(r"Rank \d parameter checksum (\S+)", result.stdout)
    assert len(checksums) == 2 and checksums[0] == checksums[1]
