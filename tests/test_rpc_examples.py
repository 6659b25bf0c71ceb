"""The model-parallel examples, run through `shoal run` as a user runs them: a parameter server with
two trainers, and a model pipelined over RPC, both trained with distributed autograd and the
DistributedOptimizer; the pipeline also loses a shard's worker and resumes from its checkpoint."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: Path, *args: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`script` on three workers under `shoal run` (with `launcher`'s options), which must succeed."""
    result = subprocess.run([sys.executable, "-m", "shoal.run", "--nproc-per-node", "3", *launcher, str(script), *args],
                            capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


def _same_as_unsplit(out: str) -> None:
    """The pipelined model ends where the unsplit one does, having learned the digits."""
    final = re.search(r"final test accuracy: pipelined ([\d.]+)%, unsplit ([\d.]+)%", out)
    assert final is not None, out[-2000:]
    assert float(final.group(1)) >= 90.0 and abs(float(final.group(1)) - float(final.group(2))) <= 1.0
    gap = re.search(r"largest parameter difference from the unsplit model: (\S+)", out)
    assert gap is not None and float(gap.group(1)) < 1e-4, out[-2000:]


def test_parameter_server_and_two_trainers_reach_90_percent() -> None:
    out = _run(ROOT / "examples" / "parameter_server.py").stdout
    for trainer in (1, 2):
        losses = [float(x) for x in re.findall(rf"trainer {trainer}, epoch \d+: loss ([\d.]+)", out)]
        assert len(losses) == 5 and losses[-1] < losses[0] / 4, losses
    final = re.search(r"final test accuracy: ([\d.]+)%", out)
    assert final is not None and float(final.group(1)) >= 90.0, out[-2000:]


def test_rpc_pipeline_trains_as_the_unsplit_model() -> None:
    _same_as_unsplit(_run(ROOT / "examples" / "rpc_pipeline.py", "--epochs", "4").stdout)


def test_rpc_pipeline_that_loses_a_shard_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """Shard 2's worker dies in epoch 1; the job starts again and restores both shards, the optimizer's
    momentum on their workers and the master's unsplit model from epoch 0's checkpoint (were any of
    them not restored, the two models would end 0.1 apart)."""
    crashed = _run(ROOT / "tests" / "scripts" / "rpc_pipeline_with_kill.py", "--kill", "2", "--checkpoint-dir",
                   str(tmp_path), "--epochs", "3", launcher=("--max-restarts", "1"))
    assert "rank 2 failed with exit code -9" in crashed.stderr and "restarting all workers" in crashed.stderr
    assert "resuming from step-0000000001.pt: epoch 1" in crashed.stdout
    _same_as_unsplit(crashed.stdout)
