"""examples/parameter_server.py with a fault: `--kill-at RANK:STEP` SIGKILLs that trainer between its
backward and its optimizer step in the server's step STEP, or (rank 0) the server once it has
applied step STEP and, with --checkpoint-dir, its checkpoint of that step is on disk, in the job's
first attempt only (tests/faults.py); every other argument goes to
the example. Run it as a module from the repository's root, so that `tests` can be imported:

    shoal run --live --nproc-per-node 4 -m tests.scripts.parameter_server_with_kill --kill-at 2:20
    shoal run --live --nproc-per-node 4 -m tests.scripts.parameter_server_with_kill --kill-at 0:20 \
        --checkpoint-dir ckpt --live
"""

import argparse
import importlib.util
import os
import sys
import threading
import time
from pathlib import Path

from tests.faults import kill_at, rank_and_step

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "parameter_server.py"

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--kill-at", type=rank_and_step, metavar="RANK:STEP", required=True)
parser.add_argument("--checkpoint-dir")
args, rest = parser.parse_known_args()
if args.checkpoint_dir:
    rest += ["--checkpoint-dir", args.checkpoint_dir]
# Imported under a name of its own on every worker, so that RPCs can name its functions.
spec = importlib.util.spec_from_file_location("parameter_server", EXAMPLE)
example = importlib.util.module_from_spec(spec)
sys.modules["parameter_server"] = example
spec.loader.exec_module(example)
on_step = kill_at(*args.kill_at)


def _watch_server() -> None:
    """On the server: the kill once it has applied step STEP."""
    while not example._server:
        time.sleep(0.005)
    steps = example._server[0].local_value().steps
    while not steps.applied or steps.applied[-1].step < args.kill_at[1]:
        time.sleep(0.005)
    manifest = Path(args.checkpoint_dir or ".") / "manifest.json"
    while args.checkpoint_dir and not (manifest.exists() and f'"step": {args.kill_at[1]}' in manifest.read_text()):
        time.sleep(0.005)
    on_step(0, args.kill_at[1])


if int(os.environ["RANK"]) == 0:
    threading.Thread(target=_watch_server, daemon=True).start()
example.main(rest, after_backward=lambda trainer, step: on_step(int(os.environ["RANK"]), step))
