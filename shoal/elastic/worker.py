"""One worker process of `shoal run`: started in a session of its own with the environment the launcher
gives it, its output copied to the launcher's with each line prefixed by its rank."""

from __future__ import annotations

import collections
import functools
import os
import subprocess
import sys
import threading
import time

from shoal.orphans import die_with_parent

_TAIL_LINES = 20  # the last lines of output kept for the failure report


class Worker:
    """The process running `command` (after the Python interpreter) as `rank`, with `env`; `changed` is
    notified when it exits. Its last lines of output are kept in `tail` for the failure report."""

    def __init__(self, rank: int, env: dict[str, str], command: list[str], changed: threading.Condition) -> None:
        self.rank, self.env = rank, env
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        # Its own session: signals reach the worker and whatever it starts through its process group,
        # sent by the launcher, and a terminal's Ctrl-C does not hit workers before the launcher decides.
        # Before exec, the worker asks for SIGKILL when the launcher dies, so no worker outlives it.
        self.proc = subprocess.Popen([sys.executable, "-u", *command], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=functools.partial(die_with_parent, os.getpid()))
        self.exited_at: float | None = None
        self._changed = changed
        self.pump = threading.Thread(target=self._forward, name=f"shoal-out-{rank}", daemon=True)
        self.pump.start()
        threading.Thread(target=self._note_exit, name=f"shoal-wait-{rank}", daemon=True).start()

    def _note_exit(self) -> None:
        self.proc.wait()
        with self._changed:
            self.exited_at = time.monotonic()
            self._changed.notify_all()

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def _forward(self) -> None:
        """Copy the worker's output, each line prefixed with its rank. A segment ending in a carriage
        return (a progress bar redrawing itself) is passed on as such, so it still redraws in place."""
        pending = b""
        for chunk in iter(lambda: self.proc.stdout.read1(1 << 16), b""):
            pending += chunk
            while (end := _line_end(pending)) >= 0:
                text, terminator = pending[:end].decode(errors="replace"), pending[end:end + 1].decode()
                pending = pending[end + 1:]
                if terminator == "\n":
                    self.tail.append(text)
                self._write(f"[rank{self.rank}]: {text}{terminator}" if text else terminator)
        if pending:
            self.tail.append(pending.decode(errors="replace"))
            self._write(f"[rank{self.rank}]: {self.tail[-1]}\n")

    @staticmethod
    def _write(text: str) -> None:
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except OSError:
            pass  # our stdout is gone (| head): keep draining the worker so it never blocks on output


def _line_end(data: bytes) -> int:
    ends = [i for i in (data.find(b"\n"), data.find(b"\r")) if i >= 0]
    return min(ends) if ends else -1
