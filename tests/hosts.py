"""Two hosts on one machine: network namespaces joined by a veth pair, for tests of what the network
between ranks does (a cable pulled, connections reset). Needs root, `ip` and `ss`."""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from tests.processes import reaped


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@functools.cache
def namespaces_missing() -> str | None:
    """Why two hosts cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to build two hosts from network namespaces"
    if shutil.which("ip") is None or shutil.which("ss") is None:
        return "needs the ip and ss commands (iproute2) to build two hosts from network namespaces"
    probe = TwoHosts(_names("probe"), _names("pv"))
    try:
        probe.connect()
        subprocess.run(["ip", "netns", "exec", probe.namespaces[0], "true"], check=True, capture_output=True,
                       timeout=10)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        stderr = exc.stderr.decode(errors="replace").strip() if exc.stderr else ""
        return f"network namespaces joined by veth are not available here: {stderr or exc}"
    finally:
        probe.tear_down()
    return None


def _names(prefix: str) -> tuple[str, str]:
    tag = secrets.token_hex(3)  # unique across runs and containers: nothing left behind collides
    return f"{prefix}a{tag}", f"{prefix}b{tag}"


@dataclass
class TwoHosts:
    """Host 0 at `addresses[0]` and host 1 at `addresses[1]`, each a network namespace; `devices` are the
    two ends of the cable between them."""

    namespaces: tuple[str, str]
    devices: tuple[str, str]
    addresses: tuple[str, str] = ("10.213.0.1", "10.213.0.2")

    @classmethod
    def build(cls) -> TwoHosts:
        hosts = cls(_names("shoal-"), _names("sh"))
        try:
            hosts.connect()
        except BaseException:
            hosts.tear_down()
            raise
        return hosts

    def connect(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        self._lay_cable(self.devices, self.addresses)

    def add_cable(self, addresses: tuple[str, str] = ("10.214.0.1", "10.214.0.2")) -> tuple[str, str]:
        """Join the hosts by a second cable, a network of its own (as hosts with a fast network beside the one
        they are reached by have); returns its two ends, host 0's first."""
        devices = _names("sd")
        self._lay_cable(devices, addresses)
        return devices

    def _lay_cable(self, devices: tuple[str, str], addresses: tuple[str, str]) -> None:
        _ip("link", "add", devices[0], "netns", self.namespaces[0], "type", "veth",
            "peer", "name", devices[1], "netns", self.namespaces[1])
        for ns, dev, address in zip(self.namespaces, devices, addresses, strict=True):
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")

    def sent(self, host: int, device: str) -> int:
        """Bytes `host`'s end `device` of a cable has sent."""
        return int(subprocess.run(["ip", "netns", "exec", self.namespaces[host], "cat",
                                   f"/sys/class/net/{device}/statistics/tx_bytes"],
                                  check=True, capture_output=True, timeout=10, text=True).stdout)

    def tear_down(self) -> None:
        """Delete both namespaces (each takes its end of the cable, and so the cable, with it)."""
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)

    def start(self, host: int, argv: list[str], env: dict[str, str], stderr, stdout=subprocess.DEVNULL,
              cwd: str | None = None) -> subprocess.Popen:
        """Run `python argv...` on `host`, its standard error to `stderr` (a file), in `cwd`."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], sys.executable, *argv],
                                env={**os.environ, **env}, stdout=stdout, stderr=stderr, cwd=cwd)

    def run_ranks(self, hosts: list[int], argv: Callable[[int], list[str]], env: Callable[[int], dict[str, str]],
                  workdir: Path, timeout: float) -> None:
        """Run rank r as `python argv(r)` on host `hosts[r]` with `env(r)`, its standard error to workdir/stderr<r>;
        wait up to `timeout` seconds for them all, and fail naming every rank that did not end well (killed if
        still running), each with the end of its standard error."""
        procs: list[subprocess.Popen] = []
        deadline, overdue = time.monotonic() + timeout, set()
        with ExitStack() as logs, reaped(procs):  # kills the overdue
            for rank, host in enumerate(hosts):
                stderr = logs.enter_context(open(workdir / f"stderr{rank}", "wb"))
                procs.append(self.start(host, argv(rank), env(rank), stderr))
            for rank, p in enumerate(procs):
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    overdue.add(rank)
        failed = {rank: (f"still running after {timeout:g} s" if rank in overdue else f"exit status {p.returncode}",
                         (workdir / f"stderr{rank}").read_text()[-3000:])
                  for rank, p in enumerate(procs) if rank in overdue or p.returncode != 0}
        assert not failed, failed

    def link(self, state: str, device: str | None = None) -> None:
        """Take host 0's end of the cable (or its end `device` of another) "down" or bring it "up"."""
        _ip("-n", self.namespaces[0], "link", "set", device or self.devices[0], state)

    def reset_connections(self, host: int, spare_port: int, to: str | None = None) -> int:
        """Abort every TCP connection `host` has to the other host (to its address `to`, else to its address on
        the first cable) except those on `spare_port`, as a failing network device would (the reset reaches the
        other side only while the link is up); returns how many there were."""
        listing = subprocess.run(["ip", "netns", "exec", self.namespaces[host], "ss", "-K", "-H", "-t", "dst",
                                  to or self.addresses[1 - host], "and", "not", "sport", "=", f":{spare_port}", "and",
                                  "not", "dport", "=", f":{spare_port}"],
                                 check=True, capture_output=True, timeout=10, text=True)
        return len(listing.stdout.splitlines())
