"""A soak on two hosts: live training while the link between them goes down and up and the transport's
connections are reset at random; then the same job with no faults, to compare.

    shoal bench soak                          # or: python benchmarks/soak.py; needs root
    shoal bench soak --epochs 400 --seed 3
    shoal bench soak --optimizer diloco       # the replicas synchronize every 3 steps, a period at a time

The hosts are tests/hosts.py's network namespaces, as in `shoal bench hosts`. On each, a launcher
(`shoal run --live --max-restarts 1 --nnodes 2`) runs two workers of tests/scripts/live_train.py: a
float64 classifier under LiveTraining, the job's store on host 0. While the job runs, every 1-4 s one
fault, drawn at random: host 0's end of the cable taken down for 0.2-3 s; every transport connection of
one host reset (`ss -K`); or both, the reset while the cable is down (the store's connection is spared:
it is not shoal's transport). Afterwards it checks that every sample was trained once per epoch, that
the workers ended alike, and, where no worker was lost, that they ended in the fault-free run's state,
digit for digit.
"""

from __future__ import annotations

import argparse
import collections
import random
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks`, `tests` importable
from tests.hosts import TwoHosts, namespaces_missing
from tests.live_reports import assert_alike, states
from tests.processes import reaped

ROOT = Path(__file__).resolve().parents[1]
STORE_PORT = 29500  # each host is a namespace of its own: no other process can hold this port there
SAMPLES = 61  # tests/scripts/live_train.py's data set


def _fault(hosts: TwoHosts, draw: random.Random) -> str:
    """Inflict one fault, drawn by `draw`; say what it was."""
    kind = draw.choice(["down", "reset", "down+reset"])
    host = draw.randrange(2)
    if kind == "reset":
        return f"reset host {host} ({hosts.reset_connections(host, spare_port=STORE_PORT)} connections)"
    down_s = draw.uniform(0.2, 3.0)
    hosts.link("down")
    try:
        reset = hosts.reset_connections(host, spare_port=STORE_PORT) if kind == "down+reset" else None
        time.sleep(down_s)
    finally:
        hosts.link("up")
    return f"link down {down_s:.1f} s" + (f", host {host} reset ({reset} connections)" if reset is not None else "")


def run_job(hosts: TwoHosts, epochs: int, workdir: Path, draw: random.Random | None,
            options: list[str]) -> tuple[str, list[str], float]:
    """The job on both hosts (live_train.py given `options`), with faults drawn by `draw` (none without); its
    workers' output, the faults, and the seconds it took. A node that fails, or a job that outlasts its
    deadline, ends the soak."""
    procs: list[subprocess.Popen] = []
    faults: list[str] = []
    with ExitStack() as files, reaped(procs):
        start = time.monotonic()
        deadline = start + 120 + 2 * epochs  # about 0.7 s an epoch under faults; 0.4 s without
        for node in (0, 1):
            argv = ["-m", "shoal.run", "--live", "--max-restarts", "1", "--nnodes", "2", "--node-rank", str(node),
                    "--nproc-per-node", "2", "--master-addr", hosts.addresses[0], "--master-port", str(STORE_PORT),
                    "-m", "tests.scripts.live_train", "--epochs", str(epochs), *options]
            env = {"SHOAL_SECRET": "soak", "SHOAL_HOST_ID": f"host{node}", "PYTHONPATH": str(ROOT)}
            out, err = (files.enter_context(open(workdir / f"{name}{node}", "wb")) for name in ("stdout", "stderr"))
            procs.append(hosts.start(node, argv, env, err, stdout=out, cwd=str(ROOT)))
        next_fault = start + (draw.uniform(1.0, 4.0) if draw is not None else float("inf"))
        while any(p.poll() is None for p in procs):
            for node, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    raise SystemExit(f"node {node} ended with status {p.returncode}:\n"
                                     f"{(workdir / f'stderr{node}').read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise SystemExit(f"the job did not end within {deadline - start:.0f} s; its last words:\n"
                                 f"{(workdir / 'stderr0').read_text()[-3000:]}")
            if time.monotonic() >= next_fault and all(p.poll() is None for p in procs):
                faults.append(_fault(hosts, draw))
                next_fault = time.monotonic() + draw.uniform(1.0, 4.0)
            time.sleep(0.1)
        seconds = time.monotonic() - start
    return "".join((workdir / f"stdout{node}").read_text() for node in (0, 1)), faults, seconds


def _final(stdout: str, epochs: int) -> tuple[str, int]:
    """The state every worker ended in, and the last generation; ends the soak unless the members' logs of
    their committed steps list every sample of every epoch exactly once, and the workers ended alike."""
    trained = collections.Counter()
    for line in stdout.splitlines():
        _, _, text = line.partition(": ")
        if text.startswith("trained "):
            epoch, *indices = map(int, text.split()[1:])
            trained.update((epoch, i) for i in indices)
    wrong = {sample: count for sample, count in trained.items() if count != 1}
    missing = epochs * SAMPLES - len(trained)
    if wrong or missing:
        raise SystemExit(f"{missing} samples never trained, {len(wrong)} trained more than once: {list(wrong)[:5]}")
    reports, finals = states(stdout)
    try:
        assert_alike(reports, finals)
    except AssertionError as exc:
        raise SystemExit(f"the workers did not end alike: {exc}") from None
    text = next(iter(finals.values()))
    return text.split(" state ")[1].split()[0], int(text.split(" generation ")[1].split()[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=300, help="epochs of 61 samples (8 steps each at 4 workers)")
    parser.add_argument("--seed", type=int, default=0, help="draws the faults")
    parser.add_argument("--optimizer", choices=["sgd", "diloco", "post-local-sgd"], default="sgd",
                        help="sgd: DDP averages every step; the others synchronize every 3 steps")
    args = parser.parse_args(argv)
    missing = namespaces_missing()
    if missing is not None:
        print(f"shoal bench soak: {missing}")
        return
    hosts = TwoHosts.build()
    try:
        with TemporaryDirectory() as tmp:
            options = [] if args.optimizer == "sgd" else [f"--{args.optimizer}"]
            stdout, faults, seconds = run_job(hosts, args.epochs, Path(tmp), random.Random(args.seed), options)
            soaked, generation = _final(stdout, args.epochs)
            print(f"under faults: {seconds:.0f} s, {len(faults)} faults, generation {generation} at the end, "
                  f"every sample once, the workers alike")
            for fault in faults:
                print(f"  {fault}")
            clean_stdout, _, clean_seconds = run_job(hosts, args.epochs, Path(tmp), None, options)
            clean, clean_generation = _final(clean_stdout, args.epochs)
            if clean_generation != 0:
                raise SystemExit("the fault-free run lost a worker: nothing to compare the soak's state with")
    finally:
        hosts.tear_down()
    print(f"no faults: {clean_seconds:.0f} s")
    if generation == 0:
        same = "the same" if soaked == clean else "NOT the same"
        print(f"no worker was lost: the final state is {same} as the fault-free run's ({soaked} and {clean})")
        if soaked != clean:
            raise SystemExit(1)
    else:
        print(f"workers were lost or joined ({generation} changes of membership): the fault-free run's state "
              f"differs by design; every sample was still trained once")


if __name__ == "__main__":
    main()
