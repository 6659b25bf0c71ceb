"""The `shoal` command: `shoal run` (the launcher), `shoal demo` (the main job), `shoal bench NAME`
(a side-by-side benchmark from benchmarks/), `shoal trace ...` (reading the traces of a run)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = ("accuracy", "allreduce", "autograd", "ddp", "dp", "faults", "hooks", "hosts", "pipeline", "recovery",
              "rpc", "rpc-recovery", "shard", "soak", "torch-backend")
# benchmarks whose file in benchmarks/ is not NAME.py
_MODULES = {"autograd": "dist_autograd", "dp": "dp_vs_ddp", "rpc-recovery": "rpc_recovery",
            "torch-backend": "torch_backend"}


def _bench(name: str, args: list[str]) -> None:
    module = _MODULES.get(name, name)
    if not (_REPO / "benchmarks" / f"{module}.py").exists():
        raise SystemExit(f"benchmark {name!r} is not in {_REPO / 'benchmarks'}; benchmarks ship with the "
                         f"source checkout (pip install -e .)")
    # Imported as a package module, not run as a path, so that spawned ranks can import it too.
    sys.path.insert(0, str(_REPO))
    importlib.import_module(f"benchmarks.{module}").main(args)


def _trace(args: argparse.Namespace) -> None:
    try:
        if args.tool == "merge":
            from shoal.observe.traces import merge

            count = merge(args.dir, args.output)
            print(f"{count} events of {args.dir} written to {args.output} (open it in https://ui.perfetto.dev "
                  f"or chrome://tracing)")
        elif args.tool == "summary":
            from shoal.observe.summary import render, summary_of

            figures = summary_of(args.dir)
            print(json.dumps(figures, indent=1) if args.json else render(figures))
        elif args.tool == "plot":
            from shoal.observe.plot import plot

            plot(args.dir, args.output, last_s=args.last)
            print(f"timeline of {args.dir} drawn in {args.output}")
        else:
            from shoal.observe.hang import report

            print(report(args.dir))
    except FileNotFoundError as exc:
        raise SystemExit(f"shoal trace {args.tool}: {exc}") from None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "run":  # the launcher parses its own (torchrun-style) flags
        from shoal.elastic.launcher import main as launch

        launch(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="shoal", description="shoal: distributed training for PyTorch")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("run", help="launch workers, as torchrun does (shoal run --help)")
    demo = commands.add_parser("demo", help="the main job: train a CNN on the digits data with DDP")
    demo.add_argument("--workers", type=int, default=2)
    demo.add_argument("--epochs", type=int, default=10)
    demo.add_argument("--backend", default="shoal", choices=["shoal", "gloo"])
    demo.add_argument("--checkpoint-dir", help="checkpoint here and resume from the newest valid checkpoint")
    demo.add_argument("--max-restarts", type=int, default=None,
                      help="restart all workers after a failure; with --live, start lost ones again (default 3)")
    demo.add_argument("--live", action="store_true", help="live recovery: when a worker dies, the others go on")
    demo.add_argument("--min-workers", type=int, default=1, help="with --live: below this, wait for workers to join")
    demo.add_argument("--trace", type=Path, metavar="DIR", help="write each worker's timeline here (shoal trace ...)")
    demo.add_argument("--metrics", type=Path, metavar="FILE", help="write a JSON line per step and worker here")
    trace = commands.add_parser("trace", help="read the timelines and flight records of a run (--trace DIR)")
    tools = trace.add_subparsers(dest="tool", required=True)
    merge = tools.add_parser("merge", help="one file of every rank for Perfetto or chrome://tracing")
    merge.add_argument("dir", type=Path)
    merge.add_argument("-o", "--output", type=Path, default=Path("trace.json"))
    summary = tools.add_parser("summary", help="per rank: time computing, communicating, both, idle")
    summary.add_argument("dir", type=Path)
    summary.add_argument("--json", action="store_true", help="print the figures as JSON")
    plot = tools.add_parser("plot", help="a picture of the timeline (needs matplotlib)")
    plot.add_argument("dir", type=Path)
    plot.add_argument("-o", "--output", type=Path, default=Path("timeline.png"))
    plot.add_argument("--last", type=float, metavar="SECONDS", help="only the run's last SECONDS")
    hang = tools.add_parser("hang", help="from the flight records: which rank is behind, and where the others wait")
    hang.add_argument("dir", type=Path)
    bench = commands.add_parser("bench", help="run a benchmark beside PyTorch's own component",
                                description="Run benchmarks/NAME.py; arguments after NAME go to it.")
    bench.add_argument("name", choices=BENCHMARKS)
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark (see NAME --help)")
    args = parser.parse_args(argv)
    if args.command == "demo" and args.live and (args.backend != "shoal" or args.checkpoint_dir):
        parser.error("demo --live trains with backend shoal and recovers live: it takes no --backend gloo or "
                     "--checkpoint-dir")
    if args.command == "bench":
        _bench(args.name, args.args)
    elif args.command == "trace":
        _trace(args)
    elif args.command == "demo":
        from shoal.elastic.launch_config import LaunchConfig
        from shoal.elastic.launcher import Launcher

        command = ["-m", "shoal.demo", "--epochs", str(args.epochs), "--backend", args.backend]
        if args.checkpoint_dir:
            command += ["--checkpoint-dir", args.checkpoint_dir]
        if args.live:
            command += ["--live", "--min-workers", str(args.min_workers)]
        if args.metrics:
            args.metrics.unlink(missing_ok=True)  # this run's lines only; the workers append
            command += ["--metrics", str(args.metrics.resolve())]
        restarts = args.max_restarts if args.max_restarts is not None else 3 if args.live else 0
        config = LaunchConfig(nproc_per_node=args.workers, max_restarts=restarts, live=args.live, command=command,
                              trace=args.trace)
        sys.exit(Launcher(config).run())


if __name__ == "__main__":
    main()
