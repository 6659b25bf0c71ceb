"""Collectives across two hosts: shoal beside gloo over a real link, and against the link's own limit.

    shoal bench hosts                      # 2 hosts x 1 and x 2 ranks; links of 1 gbit, 10 gbit, unlimited
    shoal bench hosts --quick              # 4 MiB and 64 MiB, all-reduce only, fewer repetitions
    shoal bench hosts --markdown docs/x.md # also a markdown table

The hosts are network namespaces joined by a veth pair (tests/hosts.py), the link's rate a tbf qdisc
on both ends; needs root, and says why and stops where it cannot build them. Ranks of one host share
memory (SHOAL_HOST_ID names their host); gloo talks over the veth (GLOO_SOCKET_IFNAME). Shoal and gloo
run in the same processes, in turn. A row's "of link" is the time the bytes that must cross the link
take at its rate (an all-reduce or broadcast of S bytes sends S each way, an all-gather S/2 of its output,
a reduce-scatter S/2 of its input), divided by the measured time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks`, `tests` importable
from benchmarks._steps import slowest_call
from tests.hosts import TwoHosts, namespaces_missing
from tests.processes import reaped

SIZES = {"256KiB": 256 << 10, "4MiB": 4 << 20, "64MiB": 64 << 20}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
# Bits per second (tc's gbit is 10^9).
RATES = {"10mbit": 1e7, "100mbit": 1e8, "1gbit": 1e9, "10gbit": 10e9, "unlimited": None}
# Of S bytes, what must cross the link each way between two hosts (2(h-1)/h S for an all-reduce of h hosts).
_SHARE_ACROSS = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0}
PORT = 29500  # each host is a namespace of its own: nothing else holds it there


def _op(lib, name: str, nbytes: int, world: int):
    """One call of collective `name` of `lib` (shoal.distributed or torch.distributed) on S = `nbytes`:
    the all-reduced or broadcast tensor, the all-gather's output, the reduce-scatter's input."""
    import torch

    if name == "all_reduce":
        tensor = torch.zeros(nbytes // 4)
        return lambda: lib.all_reduce(tensor)
    if name == "broadcast":
        tensor = torch.zeros(nbytes // 4)
        return lambda: lib.broadcast(tensor, src=0)
    whole, part = torch.zeros(nbytes // 4 // world * world), torch.zeros(nbytes // 4 // world)
    if name == "all_gather":
        return lambda: lib.all_gather_into_tensor(whole, part)
    return lambda: lib.reduce_scatter_tensor(part, whole)


def _worker(rank: int, world: int, address: str, collectives: list[str], sizes: list[str], repeats: int,
            out: str) -> None:
    import torch
    import torch.distributed as tdist

    import shoal.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=300)
    dist.init_process_group("shoal", f"tcp://{address}:{PORT}", rank=rank, world_size=world, timeout=timeout)
    tdist.init_process_group("gloo", f"tcp://{address}:{PORT + 1}", rank=rank, world_size=world, timeout=timeout)
    rows = []
    for name in collectives:
        for label in sizes:
            nbytes = SIZES[label]
            times = slowest_call({"shoal": _op(dist, name, nbytes, world), "gloo": _op(tdist, name, nbytes, world)},
                                 nbytes, repeats, dist.barrier)
            rows.append({"collective": name, "size": label, "nbytes": nbytes, **times})
    hosts = dist.default_group().hosts
    tdist.destroy_process_group()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "hosts": hosts}))


def shape_link(hosts: TwoHosts, rate: float | None) -> None:
    """Give both ends of the cable `rate` bits per second, or take any limit away."""
    for ns, dev in zip(hosts.namespaces, hosts.devices, strict=True):
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=10)
        if rate is not None:
            subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(rate)}bit",
                            "burst", "1mb", "latency", "50ms"], check=True, capture_output=True, timeout=10)


def _run(hosts: TwoHosts, per_host: int, collectives: list[str], sizes: list[str], repeats: int) -> dict:
    """Run 2 x `per_host` ranks, rank r on host r // per_host; rank 0's results."""
    return run_across(hosts, per_host, __file__, [",".join(collectives), ",".join(sizes), str(repeats)])


def run_across(hosts: TwoHosts, per_host: int, script: str, args: list[str]) -> dict:
    """Run `script --worker RANK WORLD ADDRESS *args OUT` as 2 x `per_host` ranks, rank r on host r // per_host,
    and return the JSON that rank 0 writes to OUT."""
    world = 2 * per_host
    with tempfile.TemporaryDirectory(prefix="shoal-bench-hosts-") as workdir:
        out = str(Path(workdir) / "result.json")
        procs: list[subprocess.Popen] = []
        with ExitStack() as logs, reaped(procs):
            for rank in range(world):
                host = rank // per_host
                env = {"SHOAL_SECRET": "bench-hosts", "SHOAL_HOST_ID": f"host{host}",
                       "GLOO_SOCKET_IFNAME": hosts.devices[host], "PYTHONPATH": str(Path(__file__).parents[1])}
                argv = [script, "--worker", str(rank), str(world), hosts.addresses[0], *args, out]
                stderr = logs.enter_context(open(Path(workdir) / f"stderr{rank}", "wb"))
                procs.append(hosts.start(host, argv, env, stderr))
            for rank, proc in enumerate(procs):
                if proc.wait(timeout=1800) != 0:
                    for other in procs:  # the first to fail may be another: keep every rank's last words
                        other.wait(timeout=60)
                    tails = "\n".join(f"rank {r}:\n{(Path(workdir) / f'stderr{r}').read_text()[-1500:]}"
                                      for r in range(world))
                    raise SystemExit(f"rank {rank} failed\n{tails}")
        return json.loads(Path(out).read_text())


def _rows(per_host: int, rate_label: str, result: dict) -> list[list[str]]:
    rate = RATES[rate_label]
    table = []
    for row in result["rows"]:
        limit = None if rate is None else _SHARE_ACROSS[row["collective"]] * row["nbytes"] * 8 / rate
        share = "-" if limit is None else f"{limit / row['shoal']:.0%}"
        gloo_share = "-" if limit is None else f"{limit / row['gloo']:.0%}"
        table.append([f"2 x {per_host}", rate_label, row["collective"], row["size"], f"{row['shoal'] * 1e3:.1f}",
                      f"{row['gloo'] * 1e3:.1f}", f"{row['gloo'] / row['shoal']:.2f}x", share, gloo_share])
    return table


HEADER = ["hosts x ranks", "link", "collective", "size", "shoal ms", "gloo ms", "shoal speed-up", "shoal of link",
          "gloo of link"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ranks-per-host", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--links", nargs="+", choices=list(RATES), default=["1gbit", "10gbit", "unlimited"])
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        rank, world, address, collectives, sizes, repeats, out = args.worker
        _worker(int(rank), int(world), address, collectives.split(","), sizes.split(","), int(repeats), out)
        return
    missing = namespaces_missing()
    if missing is not None:
        print(f"shoal bench hosts: {missing}")
        return
    collectives = ["all_reduce"] if args.quick else list(COLLECTIVES)
    sizes = ["4MiB", "64MiB"] if args.quick else list(SIZES)
    repeats = 3 if args.quick else 7
    table = []
    hosts = TwoHosts.build()
    try:
        for rate_label in args.links:
            shape_link(hosts, RATES[rate_label])
            for per_host in args.ranks_per_host:
                result = _run(hosts, per_host, collectives, sizes, repeats)
                assert len(result["hosts"]) == 2, f"the ranks did not see two hosts: {result['hosts']}"
                for line in _rows(per_host, rate_label, result):
                    print("  ".join(line), flush=True)
                    table.append(line)
    finally:
        hosts.tear_down()
    if args.markdown:
        lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(row) + " |" for row in table]
        args.markdown.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
