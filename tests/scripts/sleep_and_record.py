"""Writes its PID to the file given, then waits to be stopped."""

import os
import sys
import threading

with open(os.path.join(sys.argv[1], f"pid{os.environ['RANK']}"), "w") as f:
    f.write(str(os.getpid()))
print("ready", flush=True)
threading.Event().wait(120)  # the test stops the launcher long before this
