"""Fault injection for recovery tests: a worker killed at a step boundary, as a crashed machine would be.

The kill falls between two steps, never inside one, so a recovery test can assert exact results: every
sample trained once, the parameters of an uninterrupted run. The demo's worker takes it as its per-step
callback (`shoal.demo.main(on_step=...)`); tests/scripts/demo_with_kill.py runs it so:

    shoal run --nproc-per-node 2 --max-restarts 1 -m tests.scripts.demo_with_kill --kill-at 1:25 --checkpoint-dir ckpt
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from shoal import config


def rank_and_step(text: str) -> tuple[int, int]:
    """"RANK:STEP" (as in `--kill-at 1:25`) -> (RANK, STEP)."""
    rank, colon, step = text.partition(":")
    if not (colon and rank.isdigit() and step.isdigit()):
        raise ValueError(f"expected RANK:STEP, two whole numbers such as 1:25, got {text!r}")
    return int(rank), int(step)


def kill_at(rank: int, step: int) -> Callable[[int, int], None]:
    """A per-step callback, `on_step(rank, step)`, that SIGKILLs its own process once launch rank `rank`
    has finished step `step`, in the job's first attempt only: a worker its launcher starts again (all
    of them restarted, or one started in a lost one's place: SHOAL_RESTART_COUNT above 0) lives on."""
    first_attempt = config.SHOAL_RESTART_COUNT.get() == 0

    def on_step(at_rank: int, at_step: int) -> None:
        if first_attempt and (at_rank, at_step) == (rank, step):
            os.kill(os.getpid(), signal.SIGKILL)

    return on_step
