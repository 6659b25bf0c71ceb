"""Writes its PID to the folder given, then waits to be stopped; notes a SIGTERM when it gets one."""

import os
import signal
import sys
import threading

folder, rank = sys.argv[1], os.environ["RANK"]


def on_term(signum: int, frame: object) -> None:
    with open(os.path.join(folder, f"got-sigterm{rank}"), "w") as f:
        f.write("yes")
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
with open(os.path.join(folder, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
print("ready", flush=True)
threading.Event().wait(120)  # the test stops the launcher long before this
