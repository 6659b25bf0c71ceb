"""Per-process timeline files in Chrome's trace event format (chrome://tracing, Perfetto), written as
events happen: started by `shoal run --trace DIR`, `shoal demo --trace DIR` or SHOAL_TRACE=DIR.

A file is a JSON array, closed when the process exits; one cut short by a crash still loads in the
viewers, which accept an array without its end. Times are this process's wall clock; the offset to
rank 0's clock, once measured (comm/clock.py), is written beside them for `shoal trace merge`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any, TextIO

from shoal import config
from shoal.observe import events, flight

CLOCK_OFFSET = "shoal_clock_offset"  # metadata event: microseconds to add to align with rank 0
RANK = "shoal_rank"  # metadata event: which rank wrote the file
WRITE_EVERY_S = 0.5
_AT_ONCE = {events.FAULT, events.MEMBERSHIP}  # on disk before anything else can go wrong
_ENCODER = json.JSONEncoder(default=str, separators=(",", ":"))


class Timeline:
    """An events.Sink writing one process's trace file under `directory`.

    An event is only queued where it happens: a thread of its own encodes and writes the queue every
    WRITE_EVERY_S, in one pass, which costs a training step a fraction of encoding each event on the
    spot (a step's events each found the encoder cold). Failures and membership changes are written at once.
    `write_every_s=None` leaves the writing to `write_out()` and `close()`. The file is made with the
    first event that is not metadata: a process that records nothing (`shoal trace` itself, run where
    SHOAL_TRACE is set) leaves none.
    """

    def __init__(self, directory: Path, rank: int | None, write_every_s: float | None = WRITE_EVERY_S) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"rank{rank if rank is not None else 'unknown'}-pid{os.getpid()}.json"
        self._pid = rank if rank is not None else os.getpid()
        self._queue: deque[dict[str, Any]] = deque()  # appends and pops are atomic: emitters take no lock
        self._lock = threading.Lock()  # the file's
        self._named_threads: set[int] = set()
        self._file: TextIO | None = None
        self._recorded = False  # an event that is not metadata has been queued
        self._stopped = False  # closed, or the file failed
        if rank is not None:
            self._set_rank(rank)
        self._closing = threading.Event()
        self._writer: threading.Thread | None = None
        if write_every_s is not None:
            self._writer = threading.Thread(target=self._write_behind, args=(write_every_s,), name="shoal-timeline",
                                            daemon=True)
            self._writer.start()

    @staticmethod
    def _us(ns: int) -> float:
        return events.wall_ns(ns) / 1000

    def _write_behind(self, every_s: float) -> None:
        while not self._closing.wait(every_s):
            self.write_out()

    def write_out(self) -> None:
        """Encode and write what is queued, and flush the file. A file that cannot be written (a full
        disk) ends the timeline with a message, never the training that emits events."""
        with self._lock:
            if self._stopped or not self._recorded:
                return
            lines = []
            while self._queue:
                lines.append(_ENCODER.encode(self._queue.popleft()))
            try:
                if self._file is None:
                    self._file = open(self.path, "w")
                    self._file.write("[\n")
                elif lines:
                    self._file.write(",\n")
                self._file.write(",\n".join(lines))
                self._file.flush()
            except OSError as exc:
                print(f"shoal: timeline {self.path} stopped: {exc!r}", file=sys.stderr, flush=True)
                self._stopped = True
                self._queue.clear()
                if self._file is not None:
                    with contextlib.suppress(OSError):
                        self._file.close()

    def _add(self, event: dict[str, Any], at_once: bool = False) -> None:
        if self._stopped:
            return
        self._recorded = self._recorded or event["ph"] != "M"
        self._queue.append(event)
        if at_once:
            self.write_out()

    def _thread(self, tid: int) -> None:
        """Name a thread's track the first time it appears."""
        if tid in self._named_threads:
            return
        self._named_threads.add(tid)
        name = next((t.name for t in threading.enumerate() if t.native_id == tid), f"thread {tid}")
        self._add({"ph": "M", "name": "thread_name", "pid": self._pid, "tid": tid, "args": {"name": name}})

    def _set_rank(self, rank: int) -> None:
        self._pid = rank
        for name, args in (("process_name", {"name": f"rank {rank}"}), ("process_sort_index", {"sort_index": rank}),
                           (RANK, {"rank": rank, "os_pid": os.getpid()})):
            self._add({"ph": "M", "name": name, "pid": rank, "tid": 0, "args": args})

    # ---- events.Sink -------------------------------------------------------------------------

    def process(self, rank: int | None, clock_offset_ns: int | None) -> None:
        if rank is not None and rank != self._pid:
            self._set_rank(rank)
        if clock_offset_ns is not None:
            self._add({"ph": "M", "name": CLOCK_OFFSET, "pid": self._pid, "tid": 0,
                       "args": {"us": clock_offset_ns / 1000}}, at_once=True)

    def complete(self, name: str, cat: str, start_ns: int, end_ns: int, tid: int, args: dict[str, Any]) -> None:
        self._thread(tid)
        self._add({"ph": "X", "name": name, "cat": cat, "ts": self._us(start_ns), "dur": (end_ns - start_ns) / 1000,
                   "pid": self._pid, "tid": tid, "args": args}, at_once=cat in _AT_ONCE)

    def instant(self, name: str, cat: str, ts_ns: int, tid: int, args: dict[str, Any]) -> None:
        self._thread(tid)
        self._add({"ph": "i", "s": "p", "name": name, "cat": cat, "ts": self._us(ts_ns), "pid": self._pid,
                   "tid": tid, "args": args}, at_once=cat in _AT_ONCE)

    def flow(self, begins: bool, flow_id: int, ts_ns: int, tid: int) -> None:
        self._thread(tid)
        event = {"ph": "s" if begins else "f", "name": "p2p", "cat": "flow", "id": flow_id, "ts": self._us(ts_ns),
                 "pid": self._pid, "tid": tid}
        if not begins:
            event["bp"] = "e"  # bound to the receive that encloses it
        self._add(event)

    def close(self) -> None:
        self._closing.set()
        if self._writer is not None and self._writer is not threading.current_thread():
            self._writer.join(timeout=5)
        self.write_out()
        with self._lock, contextlib.suppress(OSError):  # write_out said so already
            if not self._stopped and self._file is not None:
                self._file.write("\n]\n")
                self._file.close()
            self._stopped = True


_timeline: Timeline | None = None


def start(directory: str | os.PathLike, rank: int | None = None) -> Timeline:
    """Trace this process into `directory` until it exits (or `stop()`)."""
    global _timeline
    if _timeline is not None:
        return _timeline
    if rank is None:
        rank = config.RANK.get()
    _timeline = Timeline(Path(directory), rank)
    events.attach(_timeline)
    atexit.register(stop)
    os.register_at_fork(after_in_child=_forget_in_child)
    return _timeline


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker, say) must not write into its parent's file (events.py
    detaches it there too)."""
    global _timeline
    _timeline = None


def stop() -> None:
    global _timeline
    if _timeline is not None:
        events.detach(_timeline)
        _timeline.close()
        _timeline = None


def start_from_environment() -> None:
    """Trace if SHOAL_TRACE names a directory; the flight record then goes there on SIGUSR1 too (the
    launcher asks for it before it stops workers)."""
    directory = config.SHOAL_TRACE.get()
    if directory is not None:
        start(directory)
        flight.dump_on_sigusr1()
