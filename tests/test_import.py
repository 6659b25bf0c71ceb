"""`import shoal` starts nothing: no thread, no trace, no signal handler, no hook installed, even with
SHOAL_TRACE set (a job starts tracing where a worker joins it). Its one effect: torch.distributed knows
backend "shoal"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_PROBE = """
import json, signal, sys, threading
before = signal.getsignal(signal.SIGUSR1)
import torch.distributed
import shoal, shoal.distributed, shoal.parallel
from shoal.observe import events
print(json.dumps({"threads": threading.active_count(), "tracing": events.active(),
                  "torch_knows_shoal": "shoal" in torch.distributed.Backend.backend_list,
                  "sigusr1_unchanged": signal.getsignal(signal.SIGUSR1) is before,
                  "autograd_imported": "shoal.autograd" in sys.modules, "rpc_imported": "shoal.rpc" in sys.modules}))
"""


def test_importing_shoal_starts_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "SHOAL_TRACE": str(tmp_path / "trace")}
    result = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"threads": 1, "tracing": False, "torch_knows_shoal": True,
                                         "sigusr1_unchanged": True, "autograd_imported": False, "rpc_imported": False}
    assert not (tmp_path / "trace").exists()
