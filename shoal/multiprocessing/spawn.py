"""Start `nprocs` copies of a function and watch them as one: the first failure stops the rest and is
raised in the parent with the child's own traceback; children never outlive the parent.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

from shoal.orphans import die_with_parent

_GRACE_S = 5.0  # how long the other children get between SIGTERM and SIGKILL once one has failed


class ProcessException(Exception):
    def __init__(self, msg: str, error_index: int, pid: int) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.pid = pid

    def __reduce__(self) -> tuple:
        return type(self), (self.msg, self.error_index, self.pid)


class ProcessRaisedException(ProcessException):
    """A child raised: the message holds its traceback."""

    def __init__(self, msg: str, error_index: int, error_pid: int) -> None:
        super().__init__(msg, error_index, error_pid)


class ProcessExitedException(ProcessException):
    """A child exited with a non-zero code or was killed by a signal, without raising."""

    def __init__(self, msg: str, error_index: int, error_pid: int, exit_code: int,
                 signal_name: str | None = None) -> None:
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self) -> tuple:
        return type(self), (self.msg, self.error_index, self.pid, self.exit_code, self.signal_name)


def _run(fn: Callable, index: int, args: tuple, error_file: str, parent_pid: int | None) -> None:
    """The child's entry point: run fn(index, *args); if it raises, leave the traceback for the parent."""
    die_with_parent(parent_pid)
    try:
        fn(index, *args)
    except KeyboardInterrupt:
        pass  # the parent is stopping everyone and reports why itself
    except Exception:  # SystemExit passes through: its code is the child's exit code
        with open(error_file, "wb") as f:
            pickle.dump(traceback.format_exc(), f)
        sys.exit(1)


class ProcessContext:
    """The children of one `start_processes` call."""

    def __init__(self, processes: list[multiprocessing.process.BaseProcess], error_dir: str) -> None:
        self.processes = processes
        self.error_dir = error_dir  # where a failing child leaves its traceback, as INDEX.err
        self._running = {p.sentinel: i for i, p in enumerate(processes)}

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds for the children; True once all have exited cleanly.

        The first child to fail stops the others (SIGTERM, then SIGKILL after a grace period) and
        its failure is raised here: ProcessRaisedException with its traceback, or ProcessExitedException.
        """
        if not self._running:
            return True
        ready = multiprocessing.connection.wait(list(self._running), timeout=timeout)
        failed = None
        for sentinel in ready:
            index = self._running.pop(sentinel)
            process = self.processes[index]
            process.join()
            if process.exitcode != 0 and failed is None:
                failed = index
        if failed is None:
            if not self._running:
                shutil.rmtree(self.error_dir, ignore_errors=True)
            return not self._running
        self._stop_the_others()
        failure = self._failure(failed)
        shutil.rmtree(self.error_dir, ignore_errors=True)
        raise failure

    def _stop_the_others(self) -> None:
        alive = [self.processes[i] for i in self._running.values()]
        for process in alive:
            process.terminate()
        deadline = time.monotonic() + _GRACE_S
        for process in alive:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        self._running.clear()

    def _failure(self, index: int) -> ProcessException:
        process = self.processes[index]
        try:
            with open(_error_file(self.error_dir, index), "rb") as f:
                trace = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            trace = None
        if trace is not None:
            msg = f"\n\n-- process {index} (pid {process.pid}) raised:\n{trace}"
            return ProcessRaisedException(msg, index, process.pid)
        code = process.exitcode
        if code < 0:
            name = signal.Signals(-code).name
            return ProcessExitedException(f"process {index} (pid {process.pid}) was killed by {name}",
                                          index, process.pid, code, name)
        return ProcessExitedException(f"process {index} (pid {process.pid}) exited with code {code}",
                                      index, process.pid, code)


def _error_file(error_dir: str, index: int) -> str:
    return os.path.join(error_dir, f"{index}.err")


def start_processes(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
                    start_method: str = "spawn") -> ProcessContext | None:
    """Run `fn(i, *args)` for i in range(nprocs), each in a process of its own.

    With `join` (the default) return once all have finished, raising the first failure; otherwise
    return the ProcessContext to join later. `fn` must be importable by the children (a module-level function).
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    context = multiprocessing.get_context(start_method)
    error_dir = tempfile.mkdtemp(prefix="shoal-spawn-")
    # A forkserver's children die with the server, which exits when this process does.
    parent_pid = None if start_method == "forkserver" else os.getpid()
    processes = []
    try:
        for index in range(nprocs):
            process = context.Process(target=_run, args=(fn, index, args, _error_file(error_dir, index), parent_pid),
                                      daemon=daemon)
            process.start()
            processes.append(process)
    except BaseException:
        for process in processes:
            process.kill()
            process.join()
        shutil.rmtree(error_dir, ignore_errors=True)
        raise
    spawned = ProcessContext(processes, error_dir)
    if not join:
        return spawned
    while not spawned.join():
        pass
    return None


def spawn(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
          start_method: str = "spawn") -> ProcessContext | None:
    """torch.multiprocessing.spawn: `start_processes` with the "spawn" start method unless told otherwise."""
    return start_processes(fn, args, nprocs, join, daemon, start_method)


__all__ = ["ProcessContext", "ProcessException", "ProcessExitedException", "ProcessRaisedException",
           "spawn", "start_processes"]

