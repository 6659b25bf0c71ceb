"""Checkpoints: round trips that continue identically, corrupted or truncated files skipped by name,
keep-last-K, asynchronous snapshots, and a writer killed mid-write leaving the previous one intact."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from shoal.checkpoint import CheckpointManager, capture_rng, restore_rng


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(8, 4) + float(np.random.rand()) + random.random()  # every RNG feeds the step
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


@pytest.mark.parametrize("async_save", [False, True])
def test_resumed_training_continues_exactly(tmp_path: Path, async_save: bool) -> None:
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    model, optimizer = _fresh()
    _train(model, optimizer, 2)
    manager = CheckpointManager(tmp_path, async_save=async_save, rank=0)
    manager.save(2, {"model": model.state_dict(), "optim": optimizer.state_dict(), "rng": capture_rng()})
    _train(model, optimizer, 3)
    manager.wait()
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    latest = manager.load_latest()
    assert latest is not None and latest.step == 2
    model, optimizer = _fresh()
    model.load_state_dict(latest.state["model"])
    optimizer.load_state_dict(latest.state["optim"])
    restore_rng(latest.state["rng"])
    _train(model, optimizer, 3)
    for a, b in zip(uninterrupted, model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_a_damaged_newest_checkpoint_is_skipped_by_name(tmp_path: Path, damage: str,
                                                        capsys: pytest.CaptureFixture) -> None:
    manager = CheckpointManager(tmp_path, rank=0)
    for step in (1, 2):
        manager.save(step, {"w": torch.full((1000,), float(step))})
    newest = tmp_path / "step-0000000002.pt"
    data = bytearray(newest.read_bytes())
    if damage == "corrupt":
        data[len(data) // 2] ^= 0xFF
        newest.write_bytes(data)
    elif damage == "truncate":
        newest.write_bytes(data[: len(data) // 3])
    else:
        newest.unlink()
    latest = manager.load_latest()
    assert latest is not None and latest.step == 1 and torch.all(latest.state["w"] == 1.0)
    assert str(newest) in capsys.readouterr().err


def test_only_the_newest_k_are_kept(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=3, rank=0)
    for step in range(6):
        manager.save(step, {"step": step})
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == [f"step-{s:010d}.pt" for s in (3, 4, 5)]
    assert manager.load_latest().state == {"step": 5}


def test_none_without_checkpoints_and_only_rank0_writes_replicated_state(tmp_path: Path) -> None:
    assert CheckpointManager(tmp_path, rank=0).load_latest() is None
    CheckpointManager(tmp_path, rank=1).save(1, {"x": 1})
    assert not list(tmp_path.glob("*.pt"))
    part = CheckpointManager(tmp_path, rank=1)
    part.save(1, {"x": 1}, per_rank=True)
    assert part.load_latest(per_rank=True).state == {"x": 1} and part.load_latest() is None


def test_async_save_snapshots_at_call_time_and_reports_errors(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, async_save=True, rank=0)
    weights = torch.zeros(1_000_000)
    manager.save(1, {"w": weights})
    weights.add_(1.0)  # training goes on while the write runs: the checkpoint must not see it
    manager.wait()
    assert torch.all(manager.load_latest().state["w"] == 0.0)
    manager.save(2, {"not saveable": lambda: None})
    with pytest.raises(RuntimeError, match="in the background failed"):
        manager.wait()
    assert manager.load_latest().step == 1


def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    child = textwrap.dedent(f"""
        import os, sys, threading, torch
        from shoal.checkpoint import CheckpointManager
        manager = CheckpointManager({str(tmp_path)!r}, async_save=True, rank=0)
        manager.save(1, {{"w": torch.ones(1000)}})
        manager.wait()
        real_fsync = os.fsync
        def stall(fd):  # the second checkpoint's bytes are written but not yet synced nor renamed
            print("writing", flush=True)
            threading.Event().wait()
        os.fsync = stall
        manager.save(2, {{"w": torch.zeros(5_000_000)}})
        threading.Event().wait()
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    latest = CheckpointManager(tmp_path, rank=0).load_latest()
    assert latest is not None and latest.step == 1 and torch.all(latest.state["w"] == 1.0)


def test_a_writer_stopped_with_sigterm_finishes_its_checkpoint_first(tmp_path: Path) -> None:
    child = textwrap.dedent(f"""
        import os, sys, threading, time, torch
        from shoal.checkpoint import CheckpointManager, finish_writes_on_sigterm
        finish_writes_on_sigterm()
        manager = CheckpointManager({str(tmp_path)!r}, async_save=True, rank=0)
        manager.save(1, {{"w": torch.ones(1000)}})
        manager.wait()
        real_fsync = os.fsync
        def slow(fd):  # the second checkpoint is still being written when SIGTERM comes
            print("writing", flush=True)
            time.sleep(1.0)
            real_fsync(fd)
        os.fsync = slow
        manager.save(2, {{"w": torch.zeros(1000)}})
        threading.Event().wait()  # training would go on here
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    latest = CheckpointManager(tmp_path, rank=0).load_latest()
    assert latest is not None and latest.step == 2 and torch.all(latest.state["w"] == 0.0)
