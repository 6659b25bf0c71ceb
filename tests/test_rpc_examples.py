"""The model-parallel examples, run through `shoal run` as a user runs them: a parameter server with
two trainers, and a model pipelined over RPC, both trained with distributed autograd and the
DistributedOptimizer. The parameter server's job also loses a trainer and goes on without it, and
its server, made again from its checkpoint or its replica; the pipeline loses a shard's worker and
resumes from its checkpoint when restarted, or builds the shard again elsewhere from the master's
replica, live."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*command: str, launcher: tuple[str, ...] = ("--nproc-per-node", "3")) -> subprocess.CompletedProcess:
    """`command` (a script or `-m module`, and its arguments) under `shoal run` with `launcher`'s
    options, from the repository's root (where -m finds tests.scripts); it must succeed."""
    result = subprocess.run([sys.executable, "-m", "shoal.run", *launcher, *command], capture_output=True, text=True,
                            timeout=110, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


def _same_as_unsplit(out: str) -> None:
    """The pipelined model ends where the unsplit one does, having learned the digits."""
    final = re.search(r"final test accuracy: pipelined ([\d.]+)%, unsplit ([\d.]+)%", out)
    assert final is not None, out[-2000:]
    assert float(final.group(1)) >= 90.0 and abs(float(final.group(1)) - float(final.group(2))) <= 1.0
    gap = re.search(r"largest parameter difference from the unsplit model: (\S+)", out)
    assert gap is not None and float(gap.group(1)) < 1e-4, out[-2000:]


def _trained(out: str, trainers: tuple[int, ...], epochs: int = 5) -> None:
    """Each of `trainers` printed `epochs` epochs' losses, the last a quarter of the first or less,
    and the server's model reached 90% on the test digits."""
    for trainer in trainers:
        losses = [float(x) for x in re.findall(rf"trainer{trainer}, epoch \d+: loss ([\d.]+)", out)]
        assert len(losses) == epochs and losses[-1] < losses[0] / 4, losses
    final = re.search(r"final test accuracy: ([\d.]+)%", out)
    assert final is not None and float(final.group(1)) >= 90.0, out[-2000:]


def test_parameter_server_and_two_trainers_reach_90_percent() -> None:
    _trained(_run("examples/parameter_server.py").stdout, trainers=(1, 2))


def test_parameter_server_goes_on_without_a_lost_trainer() -> None:
    """Trainer 2 dies between its backward and its step in epoch 1 of 5 (under --live the launcher
    lets the others go on); its batches go to the other two, which finish the job."""
    lost = _run("-m", "tests.scripts.parameter_server_with_kill", "--kill-at", "2:20",
                launcher=("--live", "--nproc-per-node", "4"))
    assert "rank 2 was lost (signal 9); the others go on without it" in lost.stderr, lost.stderr[-2000:]
    _trained(lost.stdout, trainers=(1, 3))


def test_parameter_server_replaces_a_lost_trainer_with_one_that_joins() -> None:
    """Under --max-restarts 1, the launcher starts a replacement for trainer 2, killed in step 5 of
    228; it joins the running job as trainer2.1 and trains on with the others to the end."""
    run = _run("-m", "tests.scripts.parameter_server_with_kill", "--kill-at", "2:5", "--epochs", "12",
               launcher=("--live", "--max-restarts", "1", "--nproc-per-node", "4"))
    assert "starting a new rank 2 to join them" in run.stderr, run.stderr[-2000:]
    joined = re.findall(r"trainer2\.1, epoch (\d+): loss", run.stdout)
    assert joined and joined[-1] == "11", run.stdout[-2000:]  # it trained until the last epoch
    _trained(run.stdout, trainers=(1, 3), epochs=12)


def test_parameter_server_made_again_on_a_trainer_when_lost(tmp_path: Path) -> None:
    """The server dies once it has applied its 21st step of 75 and the checkpoint after 20 is on disk
    (under --live nothing is restarted); the trainers make it again on trainer 1 from that checkpoint,
    and all three finish the five epochs."""
    lost = _run("-m", "tests.scripts.parameter_server_with_kill", "--kill-at", "0:20", "--checkpoint-dir",
                str(tmp_path), "--live", launcher=("--live", "--nproc-per-node", "4"))
    assert "rank 0 was lost (signal 9); the others go on without it" in lost.stderr, lost.stderr[-2000:]
    for trainer in (1, 2, 3):
        assert f"trainer{trainer}: the server on ps is lost; trainer1 serves from now on" in lost.stdout
    assert re.search(r"serving from \S+step-0000000020.pt, step 20\n", lost.stdout), lost.stdout[-2000:]
    _trained(lost.stdout, trainers=(1, 2, 3))


def test_parameter_server_made_again_from_its_replica_when_lost() -> None:
    """With --replicas 1 and no checkpoints, the server dies once it has applied its 26th step; the
    trainers make it again on trainer 1, from the replica it holds: of the 25 steps before, none is
    lost (the 26th is, if it was not replicated yet: no trainer had heard that it was applied)."""
    lost = _run("-m", "tests.scripts.parameter_server_with_kill", "--kill-at", "0:25", "--replicas", "1", "--live",
                launcher=("--live", "--nproc-per-node", "4"))
    assert "rank 0 was lost (signal 9); the others go on without it" in lost.stderr, lost.stderr[-2000:]
    resumed = re.search(r"serving from the replica 'shoal.elastic.TrainerSteps' on trainer1, step (\d+)\n", lost.stdout)
    assert resumed is not None and int(resumed.group(1)) in (25, 26), lost.stdout[-2000:]
    _trained(lost.stdout, trainers=(1, 2, 3))


def test_rpc_pipeline_trains_as_the_unsplit_model() -> None:
    _same_as_unsplit(_run("examples/rpc_pipeline.py", "--epochs", "4").stdout)


def test_rpc_pipeline_that_loses_a_shard_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """Shard 2's worker dies in epoch 1; the job starts again and restores both shards, the optimizer's
    momentum on their workers and the master's unsplit model from epoch 0's checkpoint (were any of
    them not restored, the two models would end 0.1 apart)."""
    crashed = _run("tests/scripts/rpc_pipeline_with_kill.py", "--kill", "2", "--checkpoint-dir", str(tmp_path),
                   "--epochs", "3", launcher=("--nproc-per-node", "3", "--max-restarts", "1"))
    assert "rank 2 failed with exit code -9" in crashed.stderr and "restarting all workers" in crashed.stderr
    assert "resuming from step 23: epoch 1" in crashed.stdout
    _same_as_unsplit(crashed.stdout)


def test_rpc_pipeline_builds_its_lost_middle_shard_again_from_the_replica(tmp_path: Path) -> None:
    """Three shards, under --live: the middle one's worker dies in epoch 1, and nothing is restarted.
    The master builds that shard again on shard 1's worker and restores every shard, their momentum
    and its unsplit model from its replica of the last step (at least as new as the checkpoint of
    epoch 0), and redoes the step it was in."""
    live = _run("tests/scripts/rpc_pipeline_with_kill.py", "--kill", "2", "--checkpoint-dir", str(tmp_path),
                "--epochs", "3", "--live", launcher=("--live", "--nproc-per-node", "4"))
    assert "rank 2 was lost (signal 9)" in live.stderr and "restarting" not in live.stderr, live.stderr[-2000:]
    rebuilt = re.search(r"lost \['shard2'\]: shard\(s\) \['second'\] built again on \['shard1'\]; every shard "
                        r"restored from memory, step (\d+)\n", live.stdout)
    assert rebuilt is not None and int(rebuilt.group(1)) >= 23, live.stdout[-2000:]
    _same_as_unsplit(live.stdout)
