"""The launcher behind `shoal run` (and `python -m shoal.run`): start one worker process per local
rank with torchrun's environment, prefix their output with the rank, and stop them all together.

    shoal run --nproc-per-node 2 train.py --epochs 3
    shoal run --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29500 --nproc-per-node 4 -m my.module
    shoal run --nnodes 1:4 --rdzv-endpoint host0:29500 --nproc-per-node 4 --live train.py  # elastic

The launcher of node 0 serves the job's rendezvous store, so the store outlives any worker; it tells
the workers so with TORCHELASTIC_USE_AGENT_STORE=True, as torchrun does (torch.distributed's own
env:// rendezvous then joins it too). With `--nnodes MIN:MAX`, the first launcher on the endpoint's
machine serves it, and the nodes agree on their ranks in it (nodes.py).

When a worker fails, the others are stopped and the failure is reported (rank, exit code, the tail
of its output); with `--max-restarts K` all workers are restarted instead, up to K times, each
attempt with a fresh store (on a fresh port unless one was given) so that no attempt reads keys
another one left behind. With `--live`, a worker killed by a signal is lost
instead: the others go on without it (shoal.elastic.live), and with `--max-restarts K` the launcher
starts a new worker in its place, up to K times in the job, which joins them; a node that arrives
after the job formed has its workers join it. With several nodes, the launcher serving the store
keeps it up until every node's workers have ended.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from shoal.comm.store import Store
from shoal.elastic.nodes import Nodes, Placement
from shoal.observe.flight import FILE_PREFIX
from shoal.orphans import die_with_parent
from shoal.ports import free_port

_GRACE_S = 10.0  # how long stopped workers get between SIGTERM and SIGKILL
_FLIGHT_DUMP_S = 3.0  # with --trace, how long workers get to write their flight records before SIGTERM
_LIVE_STRAGGLER_S = 90.0  # under --live, longer than LiveTraining's timeout: a worker this late was left behind
_TAIL_LINES = 20


@dataclass(kw_only=True)
class LaunchConfig:
    nproc_per_node: int = 1
    """Worker processes on this node."""
    nnodes: int = 1
    """Nodes in the job; with `max_nodes`, the fewest it runs with."""
    max_nodes: int | None = None
    """With `--nnodes MIN:MAX`, the most nodes in the job at once; None: exactly `nnodes`."""
    node_rank: int = 0
    """This node's index, 0..nnodes-1 (a fixed node count; with MIN:MAX the nodes agree on theirs)."""
    master_addr: str = "127.0.0.1"
    """Where one node's launcher serves the rendezvous store (node 0's, with a fixed node count)."""
    master_port: int | None = None
    """Its port; None picks a free one (single node only)."""
    run_id: str = "none"
    """The job's id (--rdzv-id), passed to the workers as TORCHELASTIC_RUN_ID."""
    join_timeout: timedelta = timedelta(seconds=600)
    """With several nodes, how long a node waits for the job's fewest nodes, or for room among its most."""
    last_call: timedelta = timedelta(seconds=5)
    """With MIN:MAX, how long after MIN nodes have arrived the job waits for more before it forms."""
    max_restarts: int = 0
    """How many times to restart all workers after a failure; with `live`, how many lost workers to replace."""
    live: bool = False
    """Keep the other workers running when one fails (live recovery, shoal.elastic.live)."""
    command: list[str] = field(default_factory=list)
    """What each worker runs, after the Python interpreter: a script and its args, or -m module args."""
    trace: Path | None = None
    """Where workers write their timelines and flight records (SHOAL_TRACE); None: no tracing."""

    def __post_init__(self) -> None:
        if self.max_nodes is None:
            self.max_nodes = self.nnodes
        if self.nproc_per_node < 1 or not 1 <= self.nnodes <= self.max_nodes:
            raise ValueError(f"--nproc-per-node ({self.nproc_per_node}) must be >= 1 and --nnodes "
                             f"({self.nnodes}:{self.max_nodes}) between 1 and MAX")
        if self.fixed_nodes and not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1}")
        if self.max_nodes > 1 and self.master_port is None:
            raise ValueError("with several nodes, give every node the same --rdzv-endpoint host:port")
        if self.max_nodes > 1 and self.max_restarts and not self.live:
            raise ValueError("--max-restarts without --live needs every node to restart together; run it with "
                             "--nnodes 1 per job, restart the whole job, or use --live (lost workers are replaced)")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not self.command:
            raise ValueError("nothing to run: give a script (and its arguments) or -m module")

    @property
    def fixed_nodes(self) -> bool:
        """The node count is fixed (`--nnodes N`): each node's rank is its --node-rank."""
        return self.nnodes == self.max_nodes


class _Worker:
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


def _is_this_machine(host: str) -> bool:
    """Whether `host` names an address of this machine (a socket can be bound to it)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, 0))
        return True
    except OSError:
        return False


def _line_end(data: bytes) -> int:
    ends = [i for i in (data.find(b"\n"), data.find(b"\r")) if i >= 0]
    return min(ends) if ends else -1


class Launcher:
    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.secret = os.environ.get("SHOAL_SECRET") or (secrets.token_hex(32) if config.max_nodes == 1 else "")
        self._workers: list[_Worker] = []
        self._replaced: list[_Worker] = []  # lost workers that new ones took the place of (--live)
        self._stopping = threading.Event()
        # Reentrant: the signal handler notifies it from the main thread, which may hold it already.
        self._changed = threading.Condition(threading.RLock())

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

    def _attempt(self, attempt: int) -> tuple[_Worker, int] | None:
        cfg = self.config
        port = cfg.master_port if cfg.master_port is not None else free_port(cfg.master_addr)
        store, serving = self._open_store(port)  # held for the attempt: dropped (and so closed) when it ends
        nodes, placement = None, Placement(cfg.node_rank, cfg.nnodes * cfg.nproc_per_node, late=False)
        if cfg.max_nodes > 1:
            me = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"  # unique even across containers
            nodes = Nodes(store.scoped(f"shoal-run/{cfg.run_id}/nodes/"), me,
                          nproc_per_node=cfg.nproc_per_node, min_nodes=cfg.nnodes, max_nodes=cfg.max_nodes,
                          stopping=self._stopping)
            placement = nodes.place(cfg.node_rank if cfg.fixed_nodes else None, join_timeout=cfg.join_timeout,
                                    last_call=cfg.last_call, take_late=cfg.live)
            nodes.keep_alive(self._connect(port).scoped(f"shoal-run/{cfg.run_id}/nodes/"),
                             watch=serving)
        base = dict(os.environ, MASTER_ADDR=cfg.master_addr, MASTER_PORT=str(port),
                    WORLD_SIZE=str(placement.world_size), LOCAL_WORLD_SIZE=str(cfg.nproc_per_node),
                    SHOAL_RESTART_COUNT=str(attempt), TORCHELASTIC_USE_AGENT_STORE="True",
                    TORCHELASTIC_RUN_ID=cfg.run_id, SHOAL_LIVE="1" if cfg.live else "0")
        if self.secret:
            base["SHOAL_SECRET"] = self.secret
        if sys.stdout.isatty():
            base["SHOAL_TTY"] = "1"  # its output reaches a terminal through us: progress may redraw itself
        if cfg.trace is not None:
            base["SHOAL_TRACE"] = str(cfg.trace.resolve())
        if placement.late:
            base["SHOAL_JOINING"] = "1"  # its workers join the running job (shoal.elastic.live)
        if not cfg.fixed_nodes:
            base["SHOAL_MIN_WORKERS"] = str(cfg.nnodes * cfg.nproc_per_node)  # below MIN nodes, live training waits
        self._workers = []
        for local in range(cfg.nproc_per_node):
            rank = placement.node_rank * cfg.nproc_per_node + local
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(local))
            self._workers.append(_Worker(rank, env, cfg.command, self._changed))
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

    def _connect(self, port: int) -> Store:
        """A client of the job's store, once it is up (another node's launcher may start later, so
        within the join timeout); the wait ends early if the launcher is told to stop."""
        cfg = self.config
        return Store.connect(cfg.master_addr, port, world_size=cfg.nnodes * cfg.nproc_per_node, is_server=False,
                             timeout=cfg.join_timeout, stop=self._stopping)

    def _watch(self) -> tuple[_Worker, int] | None:
        """Wait until every worker has exited 0 (None) or one has failed: then the worker that failed
        first (the others may only be failing because it did) and its exit code. With --live, a worker
        killed by a signal is lost, not failed: it is reported and the others go on (a new worker takes its
        place while --max-restarts allows and none has finished), and the job
        succeeds if they exit 0 (workers still running `_LIVE_STRAGGLER_S` after one has, which the
        others must have left behind as lost, are killed). An exit code of 1 or more is still a failure."""
        reported: set[_Worker] = set()
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

    def _live_failures(self, exited: list[_Worker], failed: list[_Worker], reported: set[_Worker]) -> list[_Worker]:
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

    def _restart(self, lost: _Worker) -> None:
        """Start a new worker with `lost`'s rank, which joins the others (--live --max-restarts)."""
        self._replaced.append(lost)
        print(f"shoal run: starting a new rank {lost.rank} to join them (restart {len(self._replaced)} of "
              f"{self.config.max_restarts})", file=sys.stderr)
        env = dict(lost.env, SHOAL_RESTART_COUNT=str(len(self._replaced)))
        self._workers[self._workers.index(lost)] = _Worker(lost.rank, env, self.config.command, self._changed)

    def _stop_all(self) -> None:
        alive = [w for w in self._workers if w.proc.poll() is None]
        if alive and self.config.trace is not None:
            self._collect_flight_records(alive)
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

    def _collect_flight_records(self, workers: list[_Worker]) -> None:
        """Workers about to be stopped write what they were doing (SIGUSR1, shoal.observe.flight) into
        the trace directory first, so that `shoal trace hang` can tell which was behind."""
        asked = [w for w in workers if _catches(w.proc.pid, signal.SIGUSR1)]  # else SIGUSR1 would kill it
        for worker in asked:  # the worker alone: processes it started may not handle SIGUSR1
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.proc.pid, signal.SIGUSR1)
        expected = [self.config.trace / f"{FILE_PREFIX}rank{w.rank}-pid{w.proc.pid}.json" for w in asked]
        deadline = time.monotonic() + _FLIGHT_DUMP_S
        while time.monotonic() < deadline and not all(path.exists() for path in expected):
            time.sleep(0.05)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stopping.set()
        for worker in self._workers:
            worker.signal(signum)
        with self._changed:
            self._changed.notify_all()


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (Linux's /proc says; elsewhere: assume not). A
    worker that has not imported shoal, or not yet, would die of SIGUSR1's default action."""
    try:
        with open(f"/proc/{pid}/status") as status:
            caught = next(line.split()[1] for line in status if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught, 16) >> (signum - 1) & 1)


def parse_args(argv: list[str]) -> LaunchConfig:
    """torchrun's flags, in both spellings (--nproc-per-node and --nproc_per_node). Both rendezvous
    backends torchrun names mean the same here: the store that one node's launcher serves."""
    parser = argparse.ArgumentParser(prog="shoal run", description="Start one worker per local rank.")

    def flag(name: str, **kwargs) -> None:
        parser.add_argument(f"--{name}", f"--{name.replace('-', '_')}", dest=name.replace("-", "_"), **kwargs)

    flag("nproc-per-node", type=int, default=1)
    flag("nnodes", type=str, default="1", help="N (a fixed node count), or MIN:MAX (elastic: nodes may join "
         "and leave under --live)")
    flag("node-rank", type=int, default=None, help="this node's index, with a fixed --nnodes N (0 by default)")
    flag("rdzv-endpoint", type=str, default=None, help="host:port of the job's store, the same on every node")
    flag("rdzv-backend", choices=["static", "c10d"], default="static",
         help="either way, the store that one node's launcher serves")
    flag("rdzv-id", type=str, default="none", help="the job's id, given to the workers as TORCHELASTIC_RUN_ID")
    flag("rdzv-conf", type=str, default="",
         help="with several nodes: join_timeout=SECONDS (600),last_call_timeout=SECONDS (5)")
    parser.add_argument("--standalone", action="store_true", help="one node, its store on a free local port")
    flag("master-addr", type=str, default=None)
    flag("master-port", type=int, default=None)
    flag("max-restarts", type=int, default=0)
    parser.add_argument("--trace", type=Path, default=None, metavar="DIR",
                        help="write each worker's timeline and flight record into DIR (see `shoal trace`)")
    parser.add_argument("--live", action="store_true",
                        help="when a worker fails, keep the others running (scripts using shoal.elastic.live)")
    parser.add_argument("-m", "--module", action="store_true",
                        help="SCRIPT is a module name, run as python -m does (as torchrun's -m)")
    parser.add_argument("script", nargs="?", help="the training script (or module, with -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script or module")
    args = parser.parse_args(argv)

    low, _, high = args.nnodes.partition(":")
    if not low.isdigit() or not (high or low).isdigit():
        parser.error(f"--nnodes {args.nnodes!r} must be N or MIN:MAX")
    conf = _rendezvous_conf(args.rdzv_conf, parser)
    if (high or low) != low and (args.node_rank is not None or not args.rdzv_endpoint):
        parser.error(f"--nnodes {args.nnodes}: the nodes agree on their ranks at the --rdzv-endpoint HOST:PORT "
                     f"given to every node; no --node-rank")
    if args.standalone and (args.nnodes != "1" or args.rdzv_endpoint or args.master_addr or args.master_port):
        parser.error("--standalone runs one node with its store on a free local port: it takes no --nnodes, "
                     "--rdzv-endpoint, --master-addr or --master-port")
    host, port = args.master_addr or "127.0.0.1", args.master_port
    if args.rdzv_endpoint:
        host, _, port_text = args.rdzv_endpoint.rpartition(":")
        if not host or not port_text.isdigit():
            parser.error(f"--rdzv-endpoint {args.rdzv_endpoint!r} must be host:port")
        port = int(port_text)
    command = ([*(["-m"] if args.module else []), args.script, *args.args]) if args.script else []
    try:
        return LaunchConfig(nproc_per_node=args.nproc_per_node, nnodes=int(low), max_nodes=int(high or low),
                            node_rank=args.node_rank or 0, master_addr=host, master_port=port, run_id=args.rdzv_id,
                            max_restarts=args.max_restarts, live=args.live, command=command, trace=args.trace,
                            **conf)
    except ValueError as exc:
        parser.error(str(exc))


def _rendezvous_conf(text: str, parser: argparse.ArgumentParser) -> dict[str, timedelta]:
    """torchrun's --rdzv-conf key=value,...: the two waits this launcher has."""
    names = {"join_timeout": "join_timeout", "last_call_timeout": "last_call"}
    conf = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in names:
            parser.error(f"--rdzv-conf {key!r}: known keys are {sorted(names)}")
        try:
            conf[names[key]] = timedelta(seconds=float(value))
        except (ValueError, OverflowError):
            parser.error(f"--rdzv-conf {item!r}: the value must be seconds")
    return conf


def main(argv: list[str] | None = None) -> None:
    sys.exit(Launcher(parse_args(sys.argv[1:] if argv is None else argv)).run())
