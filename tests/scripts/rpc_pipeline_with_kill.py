"""examples/rpc_pipeline.py with a fault: in the job's first attempt, worker `--kill RANK` SIGKILLs
itself as soon as the master's checkpoint after epoch 0 is on disk (in `--checkpoint-dir`, which the
example also reads), so the job loses it in epoch 1; every other argument goes to the example.

    shoal run --nproc-per-node 3 --max-restarts 1 tests/scripts/rpc_pipeline_with_kill.py --kill 2 --checkpoint-dir ckpt
    shoal run --live --nproc-per-node 4 tests/scripts/rpc_pipeline_with_kill.py --kill 2 --checkpoint-dir ckpt --live
"""

import argparse
import os
import re
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

from shoal import config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rpc_pipeline.py"


def _kill_after_epoch_0(manifest: Path) -> None:
    """Once the manifest lists a checkpoint after step 0 (the first is of the state before any step)."""
    while not (manifest.exists() and re.search(r'"step": [1-9]', manifest.read_text())):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--kill", type=int, required=True, metavar="RANK")
parser.add_argument("--checkpoint-dir", required=True)
args, rest = parser.parse_known_args()
if config.SHOAL_RESTART_COUNT.get() == 0 and int(os.environ["RANK"]) == args.kill:
    threading.Thread(target=_kill_after_epoch_0, args=(Path(args.checkpoint_dir) / "manifest.json",),
                     daemon=True).start()
sys.argv = [str(EXAMPLE), "--checkpoint-dir", args.checkpoint_dir, *rest]
runpy.run_path(str(EXAMPLE), run_name="__main__")
