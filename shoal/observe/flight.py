"""The flight recorder: each process remembers its last collectives and point-to-point operations
(sequence number, state, times), at the cost of one small record per operation, and writes them out
on SIGUSR1 and, where a directory for them is set, when an operation times out or a peer fails.
`shoal trace hang DIR` reads the files of all ranks and names the one that is behind.

SHOAL_FLIGHT_RECORDER=N keeps the last N operations (default 2000; 0 turns it off). Files go to
SHOAL_FLIGHT_DIR, else to the trace directory (SHOAL_TRACE); with neither set, only SIGUSR1 dumps, to
shoal-flight/ in the system's temporary directory. Each dump says where on stderr.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal import config

FILE_PREFIX = "flight-"


class Entry:
    """One operation as this rank saw it. `seq` counts the group's collectives, or the sends (recvs) to
    (from) one peer with one tag; `peer`/`tag` are set for point-to-point operations only. `group` is a
    number the group's members share (shoal's groups) or the group's name (torch's)."""

    __slots__ = ("ended", "error", "group", "issued", "name", "nbytes", "peer", "ranks", "seq", "started", "state",
                 "tag", "what")

    def __init__(self, group: int | str, ranks: tuple[int, ...], seq: int, name: str, what: str | Callable[[], str],
                 nbytes: int, peer: int | None, tag: int | None) -> None:
        self.group, self.ranks, self.seq, self.name, self.what = group, ranks, seq, name, what
        self.nbytes, self.peer, self.tag = nbytes, peer, tag
        self.state, self.issued = "issued", time.time()
        self.started: float | None = None
        self.ended: float | None = None
        self.error: str | None = None

    def start(self) -> None:
        self.state, self.started = "started", time.time()

    def finish(self, error: BaseException | None) -> None:
        self.state, self.ended = ("failed", time.time()) if error is not None else ("completed", time.time())
        if error is not None:
            self.error = f"{type(error).__name__}: {error}"

    def as_dict(self) -> dict[str, Any]:
        fields = {name: getattr(self, name) for name in self.__slots__}
        if callable(self.what):  # described only when dumped: the issuing path stays cheap
            fields["what"] = self.what()
        return fields


class FlightRecorder:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.forget()

    def forget(self) -> None:
        """Nothing recorded yet: at start, and in a forked child, whose parent's operations and rank are
        not its own (and whose parent's lock may be held for good)."""
        # Our rank in the job: the default group's, once it is up; until then the launcher's RANK (read
        # when a dump needs it, not at import, where a malformed RANK would stop every program).
        self.rank: int | None = None
        self._entries: collections.deque[Entry] = collections.deque(maxlen=max(self.capacity, 1))
        self._dump_lock = threading.Lock()

    def record(self, group: int | str, ranks: tuple[int, ...], seq: int, name: str, what: str | Callable[[], str],
               nbytes: int, peer: int | None = None, tag: int | None = None) -> Entry | None:
        """A new operation, just issued (`what` describes it, or gives its description when called);
        None when the recorder is off."""
        if not self.capacity:
            return None
        entry = Entry(group, ranks, seq, name, what, nbytes, peer, tag)
        self._entries.append(entry)  # deque appends are atomic: no lock on the issuing path
        return entry

    def dump(self, reason: str, *, asked: bool = False) -> Path | None:
        """Write what this process remembers, replacing its earlier dump, and return the file; an
        automatic dump (not `asked` for) is written only where a directory for dumps is set. Never
        raises: it runs on the paths that report failures, which must go on whatever the disk does."""
        given = config.SHOAL_FLIGHT_DIR.get() or config.SHOAL_TRACE.get()
        if not self.capacity or not (given or asked):
            return None
        rank = "unknown"
        try:
            known = self.rank if self.rank is not None else config.RANK.get()
            rank = "unknown" if known is None else known
            with self._dump_lock:
                directory = Path(given) if given else Path(tempfile.gettempdir()) / "shoal-flight"
                directory.mkdir(parents=True, exist_ok=True)
                path = directory / f"{FILE_PREFIX}rank{rank}-pid{os.getpid()}.json"
                record = {"rank": known, "pid": os.getpid(), "reason": reason, "time": time.time(),
                          "entries": [e.as_dict() for e in list(self._entries)]}
                part = path.with_suffix(".part")
                part.write_text(json.dumps(record, indent=1))
                part.replace(path)  # a reader never sees half a dump
        except Exception as exc:  # see above
            print(f"shoal: could not write the flight recorder of rank {rank} ({reason}): {exc!r}", file=sys.stderr,
                  flush=True)
            return None
        print(f"shoal: flight recorder of rank {rank} written to {path} ({reason})", file=sys.stderr, flush=True)
        return path


recorder = FlightRecorder(config.SHOAL_FLIGHT_RECORDER.get())
os.register_at_fork(after_in_child=recorder.forget)


def dump_on_sigusr1() -> None:
    """Dump on SIGUSR1, unless the program handles that signal itself; only the main thread can install it."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL:
        signal.signal(signal.SIGUSR1, _dump_aside)


def _dump_aside(signum: int, frame: object) -> None:
    # On a thread of its own: the handler may have interrupted a dump on the main thread.
    threading.Thread(target=recorder.dump, args=("SIGUSR1",), kwargs={"asked": True}, name="shoal-flight-dump").start()
