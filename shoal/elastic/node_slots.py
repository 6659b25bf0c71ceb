"""Which nodes a job runs on: the launchers' node slots in the job's store (not the workers' membership,
which is membership.py's).

With a fixed node count (`--nnodes N`), node R is the launcher started with `--node-rank R`. With
`--nnodes MIN:MAX`, each launcher takes the next node slot in the store as it arrives; once MIN have,
the job forms with the nodes present when MAX arrive or the last call ends, and their slots are their
node ranks. A node arriving after that is late: under `--live` its workers join the running job; at
most MAX nodes take part at once, so a late node waits while MAX are running.

A node that gives up waiting (or is stopped) withdraws, so the job never forms with it. Every node
keeps a heartbeat in the store and marks its end there; a node rank whose launcher is gone may be
taken again. The launcher that serves the store keeps serving until every other node has ended or
fallen silent, so no worker loses the store while it still trains.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from shoal.backoff import attempts
from shoal.comm.store import Store

_BEAT_S = 1.0  # how often a launcher proves it is alive
_SILENT_S = 10.0  # a launcher silent this long is gone (killed, or its machine is)
_POLL_S = 0.2


@dataclass(frozen=True)
class NodePlace:
    """Where this node's workers stand in the job."""

    node_rank: int
    world_size: int
    """Workers in the job as it formed (for a late node: as if every node before it were there)."""
    late: bool
    """The job formed without this node: its workers join it (`--live`)."""


class NodeSlots:
    """This launcher's part in the job's node membership: `me` is an id unique in the job. A slot is
    held by one launcher at a time; what a launcher reports (beats, its end) is kept under its id."""

    def __init__(self, store: Store, me: str, *, nproc_per_node: int, min_nodes: int, max_nodes: int,
                 stopping: threading.Event) -> None:
        self._store, self.me = store, me
        self._nproc, self._min, self._max = nproc_per_node, min_nodes, max_nodes
        self._stopping = stopping  # the launcher was told to stop (Ctrl-C, SIGTERM): waits end at once
        self.slot: int | None = None
        self._formed_slots: list[int] = list(range(min_nodes))  # the slots the job formed with
        self._last_beats: dict[str, tuple[int, float]] = {}  # launcher -> (beats seen, when they last changed)
        self._others: list[int] | None = None  # the other nodes running, as the heartbeat last saw them
        self._ended, self._watched = threading.Event(), threading.Event()

    def place(self, node_rank: int | None, *, join_timeout: timedelta, last_call: timedelta,
              take_late: bool) -> NodePlace:
        """Register this node and learn its place: under `node_rank` (fixed node count), or in the
        next slot (MIN:MAX). A late node waits for room among the running nodes if `take_late`, and
        raises RuntimeError otherwise. Waits for MIN nodes up to `join_timeout` (TimeoutError). A node
        that gives up withdraws, so the job never forms with it."""
        if node_rank is not None:
            self._hold(node_rank)
            return NodePlace(node_rank, self._min * self._nproc, late=False)
        self.slot = next(k for k in itertools.count() if self._store.compare_set(f"slot/{k}", self.me) == self.me)
        try:
            self._formed_slots = self._formed(join_timeout, last_call)
            if self.slot in self._formed_slots:
                return NodePlace(self._formed_slots.index(self.slot), len(self._formed_slots) * self._nproc, late=False)
            if not take_late:
                raise RuntimeError(f"the job formed with {len(self._formed_slots)} nodes before this one arrived, "
                                   f"and without --live it cannot take new nodes: start every node within the last "
                                   f"call, or run with --live")
            self._await_room(join_timeout)
        except BaseException:
            self._store.set(f"{self.me}/withdrawn", 1)
            raise
        # Its slot is past every slot taken when the job formed, so its workers' launch ranks are unused.
        return NodePlace(self.slot, (self.slot + 1) * self._nproc, late=True)

    def _hold(self, node_rank: int) -> None:
        """Take `node_rank`'s slot, from a launcher that held it before only if that one is gone."""
        self.slot = node_rank
        holder = self._store.compare_set(f"slot/{node_rank}", self.me)
        if holder == self.me:
            return
        print(f"shoal run: node rank {node_rank} was held by launcher {holder}; making sure it is gone",
              file=sys.stderr, flush=True)
        if not self._gone(holder) or self._store.replace(f"slot/{node_rank}", holder, self.me) != self.me:
            raise RuntimeError(f"node rank {node_rank} is held by a running launcher of this job ({holder}); give "
                               f"each node its own --node-rank")

    def _gone(self, holder: str) -> bool:
        """Whether launcher `holder` has ended, withdrawn, or stays silent for `_SILENT_S`."""
        deadline = time.monotonic() + _SILENT_S + _BEAT_S
        beats = self._store.add(f"{holder}/beats", 0)
        for _ in attempts(deadline, first=_POLL_S, limit=_POLL_S):
            self._check_stopping()
            if self._finished(holder, self._store):
                return True
            if self._store.add(f"{holder}/beats", 0) != beats:
                return False
        return True

    def _formed(self, join_timeout: timedelta, last_call: timedelta) -> list[int]:
        """The slots the job formed with, closing the rendezvous if nobody has yet."""
        deadline = time.monotonic() + join_timeout.total_seconds()
        told = False
        for _ in attempts(deadline, first=_POLL_S, limit=_POLL_S):
            self._check_stopping()
            if self._store.has("formed") or len(present := self._present()) >= self._min:
                break
            if not told:
                told = True
                print(f"shoal run: node slot {self.slot} is waiting for {self._min} nodes to start the job",
                      file=sys.stderr, flush=True)
        else:
            raise TimeoutError(f"only {len(present)} of the {self._min} nodes the job needs (--nnodes) arrived "
                               f"within {join_timeout.total_seconds():g}s (--rdzv-conf join_timeout)")
        closing = time.monotonic() + last_call.total_seconds()
        for _ in attempts(closing, first=_POLL_S, limit=_POLL_S):
            self._check_stopping()
            if self._store.has("formed") or len(self._present()) >= self._max:
                break
        return self._store.compare_set("formed", self._present()[:self._max])

    def _present(self) -> list[int]:
        """The slots taken, less those whose launcher withdrew (gave up waiting, or was stopped)."""
        return [slot for slot in range(self._registered(self._store))
                if not self._store.has(f"{self._store.get(f'slot/{slot}')}/withdrawn")]

    def _check_stopping(self) -> None:
        if self._stopping.is_set():
            raise InterruptedError("stopped while waiting for the job's nodes")

    @staticmethod
    def _registered(store: Store) -> int:
        return sum(1 for _ in itertools.takewhile(lambda k: store.has(f"slot/{k}"), itertools.count()))

    @staticmethod
    def _finished(holder: str, store: Store) -> bool:
        return store.has(f"{holder}/ended") or store.has(f"{holder}/withdrawn")

    def _await_room(self, timeout: timedelta) -> None:
        told = False
        for _ in attempts(time.monotonic() + timeout.total_seconds(), first=_POLL_S, limit=_POLL_S):
            self._check_stopping()
            running = self.running()
            if len(running) < self._max:
                self._store.add(f"{self.me}/beats", 1)  # counted as running from now: the others see no room
                return
            if not told:
                told = True
                print(f"shoal run: the job runs on {len(running)} nodes, its most (--nnodes ..:{self._max}); "
                      f"node slot {self.slot} waits for one to end", file=sys.stderr, flush=True)
        raise TimeoutError(f"no node of the job ended within {timeout.total_seconds():g}s to make room for this "
                           f"one (at most {self._max} nodes)")

    def running(self, store: Store | None = None) -> list[int]:
        """The other nodes' slots that have neither ended nor fallen silent, late nodes still waiting for
        room aside (asked through `store`, by default this launcher's connection). A node counts as
        silent only after it has been watched for `_SILENT_S` without a beat."""
        store = store or self._store
        now = time.monotonic()
        alive = []
        for slot in range(max(self._min, self._registered(store))):  # a fixed node count may leave gaps
            if slot == self.slot or not store.has(f"slot/{slot}"):
                continue
            holder = store.get(f"slot/{slot}")
            if self._finished(holder, store):
                continue
            beats = store.add(f"{holder}/beats", 0)
            if beats == 0 and slot not in self._formed_slots:  # a late node still waiting for room
                continue
            seen, since = self._last_beats.get(holder, (-1, now))
            if beats != seen:
                self._last_beats[holder] = (beats, now)
            elif now - since > _SILENT_S:
                continue
            alive.append(slot)
        return alive

    def keep_alive(self, store: Store, *, watch: bool) -> None:
        """Beat every `_BEAT_S` until this node ends, through `store` (a connection of the beating
        thread's own). With `watch` (the launcher serving the store), also keep noting which other nodes
        run, from now until `await_others` returns, so that one lost long before is known silent then."""
        def run() -> None:
            failing_since = None
            while True:
                try:
                    if not self._ended.is_set():
                        store.add(f"{self.me}/beats", 1)
                    if watch:
                        self._others = self.running(store)
                    failing_since = None
                except Exception:  # the store is gone with its launcher, or a request failed: retry a while
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > _SILENT_S:
                        self._others = []
                        return
                if (self._ended.is_set() and not watch) or self._watched.wait(_BEAT_S):
                    return
        threading.Thread(target=run, name="shoal-node-heartbeat", daemon=True).start()

    def end(self) -> None:
        """This node's workers have ended."""
        self._ended.set()
        self._others = None  # await_others waits for a look taken after this
        try:
            self._store.set(f"{self.me}/ended", 1)
        except Exception:  # the store is gone with its launcher: nobody is left to tell
            pass

    def await_others(self) -> None:
        """(The launcher serving the store, after `end`:) keep the store up until every other node has
        ended or fallen silent, or the launcher is told to stop."""
        told = False
        while not self._stopping.is_set() and (self._others is None or self._others):
            if self._others and not told:
                told = True
                print(f"shoal run: this node's workers have ended; it serves the job's store until node slots "
                      f"{self._others} end", file=sys.stderr, flush=True)
            self._stopping.wait(_POLL_S)
        self._watched.set()
