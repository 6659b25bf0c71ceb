"""Collectives across two hosts: shoal beside gloo over a real link, and against the link's own limit.

    shoal bench hosts                      # 2 hosts x 1 and x 2 ranks; links of 1 gbit, 10 gbit, unlimited
    shoal bench hosts --quick              # 4 MiB and 64 MiB, all-reduce only, fewer repetitions
    shoal bench hosts --markdown docs/x.md # also a markdown table
    shoal bench hosts --collectives broadcast --sizes 64KiB 256KiB --links unlimited --ranks-per-host 1
    shoal bench hosts --links 1gbit --per-flow 250mbit --streams 1 4  # a cloud's cap on each TCP connection
    shoal bench hosts --links 1gbit --cables 2 --quick  # two networks between the hosts, both used

The hosts are network namespaces joined by a veth pair (tests/hosts.py), the link's rate a tbf qdisc
on both ends; needs root, and says why and stops where it cannot build them. Ranks of one host share
memory (SHOAL_HOST_ID names their host); gloo talks over the veth (GLOO_SOCKET_IFNAME). Shoal and gloo
run in the same processes, in turn. A row's "of link" is the time the bytes that must cross the link
take at its rate (an all-reduce or broadcast of S bytes sends S each way, an all-gather S/2 of its output,
a reduce-scatter S/2 of its input), divided by the measured time.

With `--per-flow RATE`, each TCP connection across the link gets RATE at most (an htb class per connection,
chosen by its port), as clouds cap each flow, and the link as a whole its `--links` rate; `--streams N`
runs shoal with N connections per pair of ranks (SHOAL_STREAMS).

With `--cables N`, N cables join the hosts, each a network of its own at the `--links` rate; shoal and gloo
are given them all (SHOAL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME), and "of link" is against their rates together.
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

SIZES = {"64KiB": 64 << 10, "256KiB": 256 << 10, "4MiB": 4 << 20, "64MiB": 64 << 20}
DEFAULT_SIZES = ["256KiB", "4MiB", "64MiB"]
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


def shape_link(hosts: TwoHosts, rate: float | None, per_flow: float | None = None, burst: str = "1mb",
               cables: list[tuple[str, str]] | None = None) -> None:
    """Give both ends of the cable (or of each of `cables`) `rate` bits per second, or take any limit away; with
    `per_flow`, each TCP connection across it that many at most. `burst` is what the link may send at once
    above its rate, after a quiet while."""
    for devices in cables or [hosts.devices]:
        for host, (ns, dev) in enumerate(zip(hosts.namespaces, devices, strict=True)):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=10)
            if per_flow is not None:
                _shape_flows(ns, dev, rate or _UNLIMITED, per_flow, "dport" if host == 0 else "sport")
            elif rate is not None:
                _tc(ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(rate)}bit", "burst", burst,
                    "latency", "50ms")


_UNLIMITED = 100e9  # the parent class of a per-flow shaping whose link has no rate of its own
_FLOW_CLASSES = 64


def _shape_flows(ns: str, dev: str, rate: float, per_flow: float, port: str) -> None:
    """An htb class of `per_flow` bits per second for each TCP connection, under one of `rate` for all. Ranks
    on host 1 dial those on host 0 (higher ranks dial), so connections differ by host 1's port: the
    destination port on host 0's end, the source port on host 1's. Linux gives connections even ports a
    few apart, so bits 1-6 of the port tell up to 64 of them apart; the rest (ARP, non-TCP) share a
    class of its own. Each class is guaranteed little and borrows up to its cap, so the parent's rate holds."""
    floor = f"{int(rate / 80)}bit"
    quantum = ("quantum", "65536")
    _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10", "r2q", "100")
    _tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", f"{int(rate)}bit",
        "ceil", f"{int(rate)}bit", "burst", "256k", "cburst", "256k", *quantum)
    _tc(ns, "class", "add", "dev", dev, "parent", "1:1", "classid", "1:10", "htb", "rate", floor,
        "ceil", f"{int(rate)}bit", "burst", "256k", "cburst", "256k", *quantum)
    for i in range(_FLOW_CLASSES):
        flow = f"1:{0x100 + i:x}"
        _tc(ns, "class", "add", "dev", dev, "parent", "1:1", "classid", flow, "htb", "rate", floor,
            "ceil", f"{int(per_flow)}bit", "burst", "64k", "cburst", "64k", *quantum)
        _tc(ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "protocol", "6", "0xff", "match", "ip", port, str(i << 1), "0x7e", "flowid", flow)


def _tc(ns: str, *args: str) -> None:
    subprocess.run(["tc", "-n", ns, *args], check=True, capture_output=True, timeout=10)


def _run(hosts: TwoHosts, per_host: int, collectives: list[str], sizes: list[str], repeats: int,
         streams: int, cables: list[tuple[str, str]]) -> dict:
    """Run 2 x `per_host` ranks, rank r on host r // per_host, across `cables`; rank 0's results."""
    return run_across(hosts, per_host, __file__, [",".join(collectives), ",".join(sizes), str(repeats)],
                      {"SHOAL_STREAMS": str(streams)}, cables)


def run_across(hosts: TwoHosts, per_host: int, script: str, args: list[str],
               settings: dict[str, str] | None = None, cables: list[tuple[str, str]] | None = None) -> dict:
    """Run `script --worker RANK WORLD ADDRESS *args OUT` as 2 x `per_host` ranks, rank r on host r // per_host,
    with `settings` in their environment, and return the JSON that rank 0 writes to OUT. gloo talks over the
    hosts' cable, or over each of `cables`; so does shoal where there are several (SHOAL_SOCKET_IFNAME)."""
    world = 2 * per_host
    with tempfile.TemporaryDirectory(prefix="shoal-bench-hosts-") as workdir:
        out = str(Path(workdir) / "result.json")
        procs: list[subprocess.Popen] = []
        with ExitStack() as logs, reaped(procs):
            for rank in range(world):
                host = rank // per_host
                interfaces = ",".join(devices[host] for devices in cables or [hosts.devices])
                env = {"SHOAL_SECRET": "bench-hosts", "SHOAL_HOST_ID": f"host{host}", "GLOO_SOCKET_IFNAME": interfaces,
                       **({"SHOAL_SOCKET_IFNAME": interfaces} if cables and len(cables) > 1 else {}),
                       "PYTHONPATH": str(Path(__file__).parents[1]), **(settings or {})}
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


def _rows(per_host: int, rate_label: str, cables: int, streams: int, result: dict) -> list[list[str]]:
    rate = RATES[rate_label]
    table = []
    for row in result["rows"]:
        limit = None if rate is None else _SHARE_ACROSS[row["collective"]] * row["nbytes"] * 8 / (rate * cables)
        share = "-" if limit is None else f"{limit / row['shoal']:.0%}"
        gloo_share = "-" if limit is None else f"{limit / row['gloo']:.0%}"
        link = rate_label if cables == 1 else f"{cables} x {rate_label}"
        table.append([f"2 x {per_host}", link, str(max(streams, cables)), row["collective"], row["size"],
                      _ms(row["shoal"]), _ms(row["gloo"]), f"{row['gloo'] / row['shoal']:.2f}x", share, gloo_share])
    return table


def _ms(seconds: float) -> str:
    """Milliseconds to a tenth, or to a hundredth under one (the small sizes' differences)."""
    return f"{seconds * 1e3:.2f}" if seconds < 1e-3 else f"{seconds * 1e3:.1f}"


HEADER = ["hosts x ranks", "link", "shoal streams", "collective", "size", "shoal ms", "gloo ms", "shoal speed-up",
          "shoal of link", "gloo of link"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ranks-per-host", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--links", nargs="+", choices=list(RATES), default=["1gbit", "10gbit", "unlimited"])
    parser.add_argument("--per-flow", type=_bits, help="cap each TCP connection across the link at this rate "
                        "(e.g. 250mbit), under the link's")
    parser.add_argument("--streams", type=int, nargs="+", default=[1], help="SHOAL_STREAMS values to run shoal with")
    parser.add_argument("--cables", type=int, default=1, choices=range(1, 5), help="cables between the hosts, "
                        "each at the --links rate, all given to shoal and gloo")
    parser.add_argument("--collectives", nargs="+", choices=list(COLLECTIVES), help="all four unless --quick")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), help=f"{' '.join(DEFAULT_SIZES)} unless --quick")
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
    collectives = args.collectives or (["all_reduce"] if args.quick else list(COLLECTIVES))
    sizes = args.sizes or (["4MiB", "64MiB"] if args.quick else DEFAULT_SIZES)
    repeats = 3 if args.quick else 7
    table = []
    hosts = TwoHosts.build()
    try:
        cables = [hosts.devices] + [hosts.add_cable((f"10.{213 + k}.0.1", f"10.{213 + k}.0.2"))
                                    for k in range(1, args.cables)]
        for rate_label in args.links:
            shape_link(hosts, RATES[rate_label], args.per_flow, cables=cables)
            for per_host in args.ranks_per_host:
                for streams in args.streams:
                    result = _run(hosts, per_host, collectives, sizes, repeats, streams, cables)
                    assert len(result["hosts"]) == 2, f"the ranks did not see two hosts: {result['hosts']}"
                    for line in _rows(per_host, rate_label, len(cables), streams, result):
                        print("  ".join(line), flush=True)
                        table.append(line)
    finally:
        hosts.tear_down()
    if args.markdown:
        lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(row) + " |" for row in table]
        args.markdown.write_text("\n".join(lines) + "\n")


def _bits(text: str) -> float:
    """Bits per second from tc's spelling: 250mbit, 1gbit, 500kbit."""
    for unit, scale in (("kbit", 1e3), ("mbit", 1e6), ("gbit", 1e9)):
        if text.endswith(unit) and text[:-len(unit)].replace(".", "", 1).isdigit():
            return float(text[:-len(unit)]) * scale
    raise argparse.ArgumentTypeError(f"expected a rate such as 250mbit or 1gbit, not {text!r}")


if __name__ == "__main__":
    main()
