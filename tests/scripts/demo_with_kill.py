"""The demo's worker (`shoal.demo`) with a fault: `--kill-at RANK:STEP` SIGKILLs that rank after it has
finished that step, in the job's first attempt only (tests/faults.py); every other argument goes to the
demo. Run it as a module from the repository's root, so that `tests` can be imported:

    shoal run --nproc-per-node 2 --max-restarts 1 -m tests.scripts.demo_with_kill --kill-at 1:25 --checkpoint-dir ckpt
    shoal run --live --max-restarts 3 --nproc-per-node 3 -m tests.scripts.demo_with_kill --kill-at 1:20 --live
"""

import argparse

from shoal import demo
from tests.faults import kill_at, rank_and_step

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--kill-at", type=rank_and_step, metavar="RANK:STEP", help="without it, no worker is killed")
args, demo_args = parser.parse_known_args()
demo.main(demo_args, on_step=kill_at(*args.kill_at) if args.kill_at else None)
