"""examples/pipeline_digits.py, run through `shoal run` as a user runs it: two stages trained with 1F1B
reach the test accuracy of the unsplit model trained on the same batches."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pipeline_example_matches_the_unsplit_model() -> None:
    example = ROOT / "examples" / "pipeline_digits.py"
    result = subprocess.run([sys.executable, "-m", "shoal.run", "--nproc-per-node", "2", str(example)],
                            capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    final = re.search(r"final test accuracy: pipeline ([\d.]+)%, unsplit model ([\d.]+)%", result.stdout)
    assert final is not None, result.stdout[-2000:]
    ours, theirs = float(final.group(1)), float(final.group(2))
    assert ours >= 90.0 and abs(ours - theirs) <= 1.0, (ours, theirs)
    gap = re.search(r"largest parameter difference from the unsplit model \(stage 1\): (\S+)", result.stdout)
    assert gap is not None and float(gap.group(1)) < 1e-4, result.stdout[-2000:]
