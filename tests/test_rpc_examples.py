"""The model-parallel examples, run through `shoal run` as a user runs them: a parameter server with
two trainers, and a model pipelined over RPC, both trained with distributed autograd and the
DistributedOptimizer."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(example: str, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "shoal.run", "--nproc-per-node", "3",
                             str(ROOT / "examples" / example), *args], capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


def test_parameter_server_and_two_trainers_reach_90_percent() -> None:
    out = _run("parameter_server.py")
    for trainer in (1, 2):
        losses = [float(x) for x in re.findall(rf"trainer {trainer}, epoch \d+: loss ([\d.]+)", out)]
        assert len(losses) == 5 and losses[-1] < losses[0] / 4, losses
    final = re.search(r"final test accuracy: ([\d.]+)%", out)
    assert final is not None and float(final.group(1)) >= 90.0, out[-2000:]


def test_rpc_pipeline_trains_as_the_unsplit_model() -> None:
    out = _run("rpc_pipeline.py", "--epochs", "4")
    final = re.search(r"final test accuracy: pipelined ([\d.]+)%, unsplit ([\d.]+)%", out)
    assert final is not None, out[-2000:]
    assert float(final.group(1)) >= 90.0 and abs(float(final.group(1)) - float(final.group(2))) <= 1.0
    gap = re.search(r"largest parameter difference from the unsplit model: (\S+)", out)
    assert gap is not None and float(gap.group(1)) < 1e-4, out[-2000:]
