"""Rank 1 fails on the first attempt (after saying so); every rank succeeds on a restart.

With `always`, rank 1 fails on every attempt while the others wait for it until stopped."""

import sys

import shoal.distributed as dist

dist.init_process_group("shoal")
attempt = int(__import__("os").environ["SHOAL_RESTART_COUNT"])
if dist.get_rank() == 1 and (attempt == 0 or "always" in sys.argv):
    print("boom: simulated failure", flush=True)
    sys.exit(3)
t = __import__("torch").ones(3)
dist.all_reduce(t)  # the others block here until rank 1 joins or the launcher stops them
print(f"attempt {attempt} sum {t.sum().item():g}")
dist.destroy_process_group()
