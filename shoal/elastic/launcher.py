"""The launcher behind `shoal run` (and `python -m shoal.run`): start one worker process per local
rank with torchrun's environment, supervise them (restarts, live replacement), and stop them all together.
Its flags and configuration are launch_config.py's; a worker process and its rank-prefixed output, worker.py's.

    shoal run --nproc-per-node 2 train.py --epochs 3
    shoal run --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29500 --nproc-per-node 4 -m my.module
    shoal run --nnodes 1:4 --rdzv-endpoint host0:29500 --nproc-per-node 4 --live train.py  # elastic

The launcher of node 0 serves the job's rendezvous store, so the store outlives any worker; it tells
the workers so with TORCHELASTIC_USE_AGENT_STORE=True, as torchrun does (torch.distributed's own
env:// rendezvous then joins it too). With `--nnodes MIN:MAX`, the first launcher on the endpoint's
machine serves it, and the nodes agree on their ranks in it (node_slots.py). Under `--live` every
launcher keeps a replica of the store instead (shoal.comm.replicated_store), the first on the
endpoint's machine its primary, so the job outlives any node.

When a worker fails, the others are stopped and the failure is reported (rank, exit code, the tail
of its output); with `--max-restarts K` all workers are restarted instead, up to K times, each
attempt with a fresh store (on a fresh port unless one was given) so that no attempt reads keys
another one left behind. With `--live`, a worker killed by a signal is lost
instead: the others go on without it (shoal.elastic.live), and with `--max-restarts K` the launcher
starts a new worker in its place, up to K times in the job, which joins them; a node that arrives
after the job formed has its workers join it. With several nodes and without `--live`, the launcher
serving the store keeps it up until every node's workers have ended.
"""

from __future__ import annotations

import errno
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

from shoal.comm.rendezvous import local_address_towards
from shoal.comm.replicated_store import ReplicatedStore, StoreReplica
from shoal.comm.store import Store
from shoal.config import SHOAL_SECRET
from shoal.elastic.flight_records import collect_flight_records
from shoal.elastic.identity import member_id
from shoal.elastic.launch_config import LaunchConfig, parse_args
from shoal.elastic.node_slots import NodePlace, NodeSlots
from shoal.elastic.worker import Worker
from shoal.ports import free_port

_GRACE_S = 10.0  # how long stopped workers get between SIGTERM and SIGKILL
_LIVE_STRAGGLER_S = 90.0  # under --live, longer than LiveTraining's timeout: a worker this late was left behind


def _is_this_machine(host: str) -> bool:
    """Whether `host` names an address of this machine (a socket can be bound to it)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, 0))
        return True
    except OSError:
        return False


class Launcher:
    """This node's part of a job, as `config` says: its workers, their restarts, and their end."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.secret = SHOAL_SECRET.get() or (secrets.token_hex(32) if config.max_nodes == 1 else "")
        self._workers: list[Worker] = []
        self._replaced: list[Worker] = []  # lost workers that new ones took the place of (--live)
        self._stopping = threading.Event()
        # Reentrant: the signal handler notifies it from the main thread, which may hold it already.
        self._changed = threading.Condition(threading.RLock())
        self._replica: StoreReplica | None = None  # this node's replica of the job's store (--live)

    def run(self) -> int:
        """Run the job to the end; returns the exit code for the launcher's own process."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            attempts = 1 if self.config.live else self.config.max_restarts + 1  # --live restarts lost workers only
            for attempt in range(attempts):
                try:
                    failed = self._attempt(attempt)
                except (OSError, RuntimeError) as exc:  # no store, a worker could not start, no place among the nodes
                    if self._stopping.is_set():
                        return 128 + signal.SIGTERM
                    print(f"shoal run: {exc}", file=sys.stderr)
                    return 1
                if failed is None:
                    return 0
                if self._stopping.is_set():
                    return 128 + signal.SIGTERM
                worker, code = failed
                print(f"shoal run: rank {worker.rank} failed with exit code {code} (attempt {attempt + 1} of "
                      f"{attempts}); its last output:", file=sys.stderr)
                for line in worker.tail:
                    print(f"    {line}", file=sys.stderr)
                if attempt + 1 < attempts:
                    print("shoal run: restarting all workers", file=sys.stderr)
            return 1
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _attempt(self, attempt: int) -> tuple[Worker, int] | None:
        cfg = self.config
        port = cfg.master_port if cfg.master_port is not None else free_port(cfg.master_addr)
        self._replica = self._start_replica(port) if cfg.live else None
        try:
            return self._attempt_on(port, attempt)
        finally:
            if self._replica is not None:
                self._replica.close()

    def _attempt_on(self, port: int, attempt: int) -> tuple[Worker, int] | None:
        cfg = self.config
        # Held for the attempt: dropped (and so closed) when it ends. A replicated store needs nobody to
        # serve it longer than its own node runs: another replica takes over.
        store, serving = (self._connect(port), False) if self._replica else self._open_store(port)
        nodes, place = None, NodePlace(cfg.node_rank, cfg.nnodes * cfg.nproc_per_node, late=False)
        if cfg.max_nodes > 1:
            nodes = NodeSlots(store.scoped(f"shoal-run/{cfg.run_id}/nodes/"), member_id(),
                              nproc_per_node=cfg.nproc_per_node, min_nodes=cfg.nnodes, max_nodes=cfg.max_nodes,
                              stopping=self._stopping)
            nodes.keep_alive(self._connect(port).scoped(f"shoal-run/{cfg.run_id}/nodes/"), watch=serving)
            place = nodes.place(cfg.node_rank if cfg.fixed_nodes else None, join_timeout=cfg.join_timeout,
                                last_call=cfg.last_call, take_late=cfg.live)
        base = dict(os.environ, MASTER_ADDR=cfg.master_addr, MASTER_PORT=str(port),
                    WORLD_SIZE=str(place.world_size), LOCAL_WORLD_SIZE=str(cfg.nproc_per_node),
                    SHOAL_RESTART_COUNT=str(attempt), TORCHELASTIC_USE_AGENT_STORE="True",
                    TORCHELASTIC_RUN_ID=cfg.run_id, SHOAL_LIVE="1" if cfg.live else "0")
        if self.secret:
            base["SHOAL_SECRET"] = self.secret
        base.pop("SHOAL_STORE_REPLICAS", None)  # an outer --live job's, were this launcher started by its worker
        if self._replica is not None:
            base["SHOAL_STORE_REPLICAS"] = self._replica.address
        if sys.stdout.isatty():
            base["SHOAL_TTY"] = "1"  # its output reaches a terminal through us: progress may redraw itself
        if cfg.trace is not None:
            base["SHOAL_TRACE"] = str(cfg.trace.resolve())
        if place.late:
            base["SHOAL_JOINING"] = "1"  # its workers join the running job (shoal.elastic.live)
        if not cfg.fixed_nodes:
            base["SHOAL_MIN_WORKERS"] = str(cfg.nnodes * cfg.nproc_per_node)  # below MIN nodes, live training waits
        self._workers = []
        for local in range(cfg.nproc_per_node):
            rank = place.node_rank * cfg.nproc_per_node + local
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(local))
            self._workers.append(Worker(rank, env, cfg.command, self._changed))
        try:
            return self._watch()
        finally:
            self._stop_all()
            if nodes is not None:
                nodes.end()
                if serving:
                    nodes.await_others()
            del store

    def _open_store(self, port: int) -> tuple[Store, bool]:
        """The job's store, and whether this launcher serves it: node 0 with a fixed node count; with
        MIN:MAX, the first launcher on the endpoint's machine (torchrun's c10d rendezvous does the same)."""
        cfg = self.config
        if cfg.node_rank == 0 if cfg.fixed_nodes else _is_this_machine(cfg.master_addr):
            try:
                return Store.connect(cfg.master_addr, port, world_size=cfg.nnodes * cfg.nproc_per_node,
                                     is_server=True), True
            except OSError:
                if cfg.fixed_nodes:
                    raise  # the port is someone else's
        return self._connect(port), False

    def _start_replica(self, port: int) -> StoreReplica:
        """This node's replica of the job's store (--live): the primary if this launcher is the first on the
        endpoint's machine, else a follower, on the endpoint's port of this node's address where that is free,
        so that a node arriving after the endpoint's node is lost may name any running node's address."""
        cfg = self.config
        endpoint = f"{cfg.master_addr}:{port}"
        if _is_this_machine(cfg.master_addr):
            try:
                return StoreReplica(cfg.master_addr, port)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                if cfg.max_nodes == 1:
                    raise OSError(f"rendezvous port {endpoint} is already in use; pick another or stop the "
                                  f"process holding it") from None
        address, join = local_address_towards(cfg.master_addr), cfg.join_timeout.total_seconds()
        try:
            return StoreReplica(address, port, follow=endpoint, join_timeout=join, stop=self._stopping)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
        return StoreReplica(address, 0, follow=endpoint, join_timeout=join, stop=self._stopping)

    def _connect(self, port: int) -> Store:
        """A client of the job's store, once it is up (another node's launcher may start later, so
        within the join timeout); the wait ends early if the launcher is told to stop."""
        cfg = self.config
        if self._replica is not None:
            return Store(ReplicatedStore([self._replica.address, f"{cfg.master_addr}:{port}"],
                                         timeout=cfg.join_timeout, stop=self._stopping))
        return Store.connect(cfg.master_addr, port, world_size=cfg.nnodes * cfg.nproc_per_node, is_server=False,
                             timeout=cfg.join_timeout, stop=self._stopping)

    def _watch(self) -> tuple[Worker, int] | None:
        """Wait until every worker has exited 0 (None) or one has failed: then the worker that failed
        first (the others may only be failing because it did) and its exit code. With --live, a worker
        killed by a signal is lost, not failed: it is reported and the others go on (a new worker takes its
        place while --max-restarts allows and none has finished), and the job
        succeeds if they exit 0 (workers still running `_LIVE_STRAGGLER_S` after one has, which the
        others must have left behind as lost, are killed). An exit code of 1 or more is still a failure."""
        reported: set[Worker] = set()
        while not self._stopping.is_set():
            with self._changed:
                exited = [w for w in self._workers if w.exited_at is not None]
                failed = sorted((w for w in exited if w.proc.returncode != 0), key=lambda w: w.exited_at)
                if self.config.live:
                    failed = self._live_failures(exited, failed, reported)
                    exited = [w for w in exited if w in self._workers]  # a new worker may have taken a lost one's place
                if not failed and len(exited) < len(self._workers):
                    self._changed.wait(timeout=1.0)
                    continue
            if failed:
                failed[0].pump.join(timeout=2)
                return failed[0], failed[0].proc.returncode
            for worker in self._workers:
                worker.pump.join(timeout=5)
            return None
        return self._workers[0], 128 + signal.SIGTERM

    def _live_failures(self, exited: list[Worker], failed: list[Worker], reported: set[Worker]) -> list[Worker]:
        """Of the failed workers, those that fail the job under --live; reports the lost ones."""
        running = [w for w in self._workers if w.exited_at is None]
        finished = [w.exited_at for w in exited if w.proc.returncode == 0]
        for worker in failed:
            if worker.proc.returncode < 0 and worker not in reported and running:
                reported.add(worker)
                print(f"shoal run: rank {worker.rank} was lost (signal {-worker.proc.returncode}); the others go on "
                      f"without it (--live)", file=sys.stderr)
                if len(self._replaced) < self.config.max_restarts and not finished:  # the job is not ending
                    self._restart(worker)
        failed = [w for w in failed if w in self._workers]
        if finished and running and time.monotonic() - min(finished) > _LIVE_STRAGGLER_S:
            for worker in running:
                print(f"shoal run: rank {worker.rank} is still running {_LIVE_STRAGGLER_S:g}s after the others "
                      f"finished: the others left it behind as lost; stopping it", file=sys.stderr)
                worker.signal(signal.SIGKILL)
        errors = [w for w in failed if w.proc.returncode > 0]
        return errors or (failed if len(failed) == len(self._workers) else [])

    def _restart(self, lost: Worker) -> None:
        """Start a new worker with `lost`'s rank, which joins the others (--live --max-restarts)."""
        self._replaced.append(lost)
        print(f"shoal run: starting a new rank {lost.rank} to join them (restart {len(self._replaced)} of "
              f"{self.config.max_restarts})", file=sys.stderr)
        env = dict(lost.env, SHOAL_RESTART_COUNT=str(len(self._replaced)))
        self._workers[self._workers.index(lost)] = Worker(lost.rank, env, self.config.command, self._changed)

    def _stop_all(self) -> None:
        alive = [w for w in self._workers if w.proc.poll() is None]
        if alive and self.config.trace is not None:
            collect_flight_records(alive, self.config.trace)
        if not self._stopping.is_set():  # after Ctrl-C/SIGTERM the workers already have the signal
            for worker in alive:
                worker.signal(signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        for worker in alive:
            try:
                worker.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.signal(signal.SIGKILL)
                worker.proc.wait()
        for worker in [*self._replaced, *self._workers]:
            worker.pump.join(timeout=2)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stopping.set()
        for worker in self._workers:
            worker.signal(signum)
        with self._changed:
            self._changed.notify_all()


def main(argv: list[str] | None = None) -> None:
    sys.exit(Launcher(parse_args(sys.argv[1:] if argv is None else argv)).run())
