"""What `shoal run` is asked to do: torchrun's flags (`parse_args`) and the launch configuration they
make (`LaunchConfig`), checked before any worker starts."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path


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
