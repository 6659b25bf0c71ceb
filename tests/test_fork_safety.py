"""shoal in processes forked the usual way: from a parent that ran parallel torch ops, at torch's default
threads. OpenMP's threads for a forked process's main thread are the parent's, which the child lacks;
work shoal does on a worker's behalf runs on threads started in the child, as torch's does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.scripts import fork_parameter_server as program

ROOT = Path(__file__).resolve().parents[1]


def _replay() -> list[float]:
    """The trainer's steps in one process, without RPC: the same model, data and optimizer."""
    server, local = program.Server(), program.embedding()
    optimizer = torch.optim.SGD([*server.layer.parameters(), *local.parameters()], lr=program.LR)
    losses = []
    for indices in program.trainer_batches():
        optimizer.zero_grad()
        features = local(indices)
        loss = server.forward(features).sum() + features.sum()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_a_parameter_server_forked_after_a_parallel_op_trains_ten_rounds_in_a_row() -> None:
    env = {name: value for name, value in os.environ.items() if not name.endswith("_NUM_THREADS")}
    result = subprocess.run([sys.executable, "-m", "tests.scripts.fork_parameter_server", "--rounds", "10"],
                            capture_output=True, text=True, timeout=20 * program.DEADLINE_S, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    rounds = [line.split(": losses ")[1] for line in result.stdout.splitlines() if ": losses " in line]
    assert len(rounds) == 10, result.stdout
    want = _replay()
    for losses in rounds:
        torch.testing.assert_close([float(loss) for loss in losses.split()], want)
