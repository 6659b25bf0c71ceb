"""Fault injection for recovery tests: `SHOAL_FAULT_KILL_AT=RANK:STEP` makes that rank SIGKILL itself
after finishing that step, in the first attempt only (SHOAL_RESTART_COUNT=0), as a crashed machine would."""

from __future__ import annotations

import os
import signal


def maybe_kill(rank: int, step: int) -> None:
    target = os.environ.get("SHOAL_FAULT_KILL_AT")
    if not target or os.environ.get("SHOAL_RESTART_COUNT", "0") != "0":
        return
    kill_rank, _, kill_step = target.partition(":")
    if int(kill_rank) == rank and int(kill_step) == step:
        os.kill(os.getpid(), signal.SIGKILL)
