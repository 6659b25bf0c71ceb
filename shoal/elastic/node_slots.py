"""Which nodes a job runs on: the launchers' node slots in the job's store (not the workers' membership,
which is membership.py's).

With a fixed node count (`--nnodes N`), node R is the launcher started with `--node-rank R`. With
`--nnodes MIN:MAX`, each launcher takes the next node slot in the store as it arrives; once MIN are
alive, the job forms with the nodes alive when MAX are or the last call ends, ranked in slot order. A
node arriving after that is late: under `--live` its workers join the running job, once the node has
taken one of the job's MAX seats (the formed nodes hold the first ones), so at most MAX take part at once.

Every node beats in the store from the moment it takes its slot, and marks its end there. A node that
gives up waiting (or is stopped) withdraws; one that falls silent (killed while it waits) is left out
of the job; a node rank or seat whose launcher is gone may be taken again. The launcher that serves the
store keeps serving until every other node has ended or fallen silent, so no worker loses the store
while it still trains.
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


class _Beats:
    """What one thread has seen of other launchers' beats. A launcher is alive while its count has changed
    within a few beats, as watched; silent once it has not for `_SILENT_S` (from first sight: it had that
    long to beat); unknown in between (just seen, or late to beat: killed a moment ago, or slow)."""

    UNKNOWN, ALIVE, SILENT = "unknown", "alive", "silent"

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, float, bool]] = {}  # launcher -> (beats, when they last changed, changed)

    def look(self, store: Store, holder: str) -> str:
        now, beats = time.monotonic(), store.add(f"{holder}/beats", 0)
        count, since, changed = self._seen.get(holder, (beats, now, False))
        if beats != count:
            count, since, changed = beats, now, True
        self._seen[holder] = (count, since, changed)
        if now - since > _SILENT_S:
            return self.SILENT
        return self.ALIVE if changed and now - since <= 3 * _BEAT_S else self.UNKNOWN


class NodeSlots:
    """This launcher's part in the job's node membership: `me` is an id unique in the job. A slot (and a
    seat) is held by one launcher at a time; what a launcher reports (beats, its end) is kept under its id."""

    def __init__(self, store: Store, me: str, *, nproc_per_node: int, min_nodes: int, max_nodes: int,
                 stopping: threading.Event) -> None:
        self._store, self.me = store, me
        self._nproc, self._min, self._max = nproc_per_node, min_nodes, max_nodes
        self._stopping = stopping  # the launcher was told to stop (Ctrl-C, SIGTERM): waits end at once
        self.slot: int | None = None
        self._beats = _Beats()  # as this launcher's main thread sees the others
        self._others: list[int] | None = None  # the other nodes running, as the heartbeat last saw them
        self._ended, self._watched = threading.Event(), threading.Event()

    def place(self, node_rank: int | None, *, join_timeout: timedelta, last_call: timedelta,
              take_late: bool) -> NodePlace:
        """Register this node and learn its place: under `node_rank` (fixed node count), or in the
        next slot (MIN:MAX). A late node waits for a free seat if `take_late`, and raises RuntimeError
        otherwise. Waits for MIN nodes up to `join_timeout` (TimeoutError). A node that gives up
        withdraws, so the job never forms with it. Call `keep_alive` first: the others leave a silent
        node out."""
        try:
            if node_rank is not None:
                self._hold(node_rank)
                return NodePlace(node_rank, self._min * self._nproc, late=False)
            self.slot = next(k for k in itertools.count()
                             if self._store.compare_set(f"slot/{k}", self.me) == self.me)
            formed = self._formed(join_timeout, last_call)
            if self.slot in formed:
                return NodePlace(formed.index(self.slot), len(formed) * self._nproc, late=False)
            if not take_late:
                raise RuntimeError(f"the job formed with {len(formed)} nodes before this one arrived, "
                                   f"and without --live it cannot take new nodes: start every node within the last "
                                   f"call, or run with --live")
            self._await_seat(formed, join_timeout)
        except BaseException:
            self._store.set(f"{self.me}/withdrawn", 1)
            self._ended.set()  # it beats no more
            self._watched.set()
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
        for _ in attempts(time.monotonic() + _SILENT_S + _BEAT_S, first=_POLL_S, limit=_POLL_S):
            self._check_stopping()
            if self._finished(holder, self._store):
                return True
            if self._beats.look(self._store, holder) == _Beats.ALIVE:
                return False
        return True

    def _formed(self, join_timeout: timedelta, last_call: timedelta) -> list[int]:
        """The slots the job formed with, closing the rendezvous if nobody has yet: once MIN nodes are
        alive, with those alive when MAX are or the last call ends, and none is unknown (a node killed as
        it registered never beats; one killed while it waited has stopped: both end silent)."""
        deadline = time.monotonic() + join_timeout.total_seconds()
        closing, alive, told = None, [], False
        while not self._store.has("formed"):
            self._check_stopping()
            alive, unknown = self._alive()
            now = time.monotonic()
            if len(alive) >= self._min:
                closing = closing or now + last_call.total_seconds()
                if not unknown and (len(alive) >= self._max or now >= closing):
                    break
            else:
                closing = None  # one fell silent during the last call: wait for MIN again
                if now >= deadline:
                    raise TimeoutError(f"only {len(alive)} of the {self._min} nodes the job needs (--nnodes) "
                                       f"arrived within {join_timeout.total_seconds():g}s (--rdzv-conf join_timeout)")
                if not told:
                    told = True
                    print(f"shoal run: node slot {self.slot} is waiting for {self._min} nodes to start the job",
                          file=sys.stderr, flush=True)
            time.sleep(_POLL_S)
        return self._store.compare_set("formed", alive[:self._max])

    def _alive(self) -> tuple[list[int], list[int]]:
        """The slots taken whose launcher is alive, and those just seen, not yet confirmed; a slot whose
        launcher withdrew (gave up waiting, or was stopped) or fell silent is neither."""
        alive, unknown = [], []
        for slot in range(self._registered(self._store)):
            holder = self._store.get(f"slot/{slot}")
            if self._store.has(f"{holder}/withdrawn"):
                continue
            seen = _Beats.ALIVE if slot == self.slot else self._beats.look(self._store, holder)
            if seen == _Beats.ALIVE:
                alive.append(slot)
            elif seen == _Beats.UNKNOWN:
                unknown.append(slot)
        return alive, unknown

    def _check_stopping(self) -> None:
        if self._stopping.is_set():
            raise InterruptedError("stopped while waiting for the job's nodes")

    @staticmethod
    def _registered(store: Store) -> int:
        return sum(1 for _ in itertools.takewhile(lambda k: store.has(f"slot/{k}"), itertools.count()))

    @staticmethod
    def _finished(holder: str, store: Store) -> bool:
        return store.has(f"{holder}/ended") or store.has(f"{holder}/withdrawn")

    def _await_seat(self, formed: list[int], timeout: timedelta) -> None:
        told = False
        for _ in attempts(time.monotonic() + timeout.total_seconds(), first=_POLL_S, limit=_POLL_S):
            self._check_stopping()
            if self._take_seat(formed):
                return
            if not told:
                told = True
                print(f"shoal run: the job runs on {self._max} nodes, its most (--nnodes ..:{self._max}); "
                      f"node slot {self.slot} waits for one to end", file=sys.stderr, flush=True)
        raise TimeoutError(f"no node of the job ended within {timeout.total_seconds():g}s to make room for this "
                           f"one (at most {self._max} nodes)")

    def _take_seat(self, formed: list[int]) -> bool:
        """Take one of the job's MAX seats, free or held by a launcher that is gone, in one compare-and-set:
        two late nodes never both take the last one. The nodes the job formed with hold the first seats."""
        for seat in range(self._max):
            first = self._store.get(f"slot/{formed[seat]}") if seat < len(formed) else self.me
            holder = self._store.compare_set(f"seat/{seat}", first)
            if holder == self.me:
                return True
            gone = self._finished(holder, self._store) or self._beats.look(self._store, holder) == _Beats.SILENT
            if gone and self._store.replace(f"seat/{seat}", holder, self.me) == self.me:
                return True
        return False

    def _running(self, store: Store, beats: _Beats) -> list[int]:
        """The other nodes' slots that have neither ended nor fallen silent (as `beats` has seen them),
        asked through `store`."""
        alive = []
        for slot in range(max(self._min, self._registered(store))):  # a fixed node count may leave gaps
            if slot == self.slot or not store.has(f"slot/{slot}"):
                continue
            holder = store.get(f"slot/{slot}")
            if not self._finished(holder, store) and beats.look(store, holder) != _Beats.SILENT:
                alive.append(slot)
        return alive

    def keep_alive(self, store: Store, *, watch: bool) -> None:
        """Beat every `_BEAT_S` until this node ends, through `store` (a connection of the beating
        thread's own). With `watch` (the launcher serving the store), also keep noting which other nodes
        run, from now until `await_others` returns, so that one lost long before is known silent then."""
        beats = _Beats()  # as this thread sees the others

        def run() -> None:
            failing_since = None
            while True:
                try:
                    if not self._ended.is_set():
                        store.add(f"{self.me}/beats", 1)
                    if watch:
                        self._others = self._running(store, beats)
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
        """This node's workers have ended (or it never placed them)."""
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
