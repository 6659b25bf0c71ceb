"""One rank of a two-host job: all-reduce in rounds, checking every result, until a file named `stop`
appears in the work directory; then write how it ended to `result<rank>.json` there.

Usage: all_reduce_until_stopped.py RANK MASTER_ADDR MASTER_PORT WORKDIR
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

import shoal
import shoal.distributed as dist

NUMEL = 1 << 18

rank, master, port, workdir = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
dist.init_process_group("shoal", f"tcp://{master}:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60))
rounds, outcome, failed_after = 0, "stopped", None
while True:
    # The last element carries the stop signal, so that both ranks stop after the same round.
    t = torch.full((NUMEL + 1,), float(rank + rounds))
    t[-1] = float((workdir / "stop").exists())
    began = time.monotonic()
    try:
        dist.all_reduce(t)
    except shoal.PeerFailure as exc:
        outcome, failed_after = f"PeerFailure: {exc}", time.monotonic() - began
        break
    if not torch.equal(t[:-1], torch.full((NUMEL,), float(2 * rounds + 1))):
        outcome = f"wrong result in round {rounds}"
        break
    rounds += 1
    # Replaced whole: a file written in place reads empty for a moment, and rounds come every few milliseconds.
    (workdir / f"progress{rank}.new").write_text(str(rounds))
    os.replace(workdir / f"progress{rank}.new", workdir / f"progress{rank}")
    if t[-1] > 0:
        break
(workdir / f"result{rank}.json").write_text(json.dumps({"outcome": outcome, "rounds": rounds,
                                                        "failed_after": failed_after}))
dist.destroy_process_group()
