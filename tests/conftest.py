"""Fixtures shared by the test files: a guard that fails any test leaving a process of its own running,
and two hosts built from network namespaces for tests of the network between ranks."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

# Children that multiprocessing keeps for the whole session by design, not started by any one test.
_SESSION_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
_EXIT_GRACE_S = 5.0


def _running_children() -> dict[int, str]:
    """This process's children that still run (an exited child not yet waited for is left out), with
    their command lines."""
    me = str(os.getpid())
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, parent = f.read().rsplit(")", 1)[1].split()[:2]
            if parent != me or state in ("Z", "X"):
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError):
            continue  # it ended while we looked
        if not any(helper in command for helper in _SESSION_HELPERS):
            found[int(entry)] = command
    return found


@pytest.fixture(autouse=True)
def leaves_no_process_behind() -> Iterator[None]:
    """Every test cleans up the processes it starts: one still running after the test (and a short grace
    for those on their way out) is killed, and the test fails naming it."""
    if not os.path.isdir("/proc/self"):
        yield
        return
    before = set(_running_children())
    yield
    deadline = time.monotonic() + _EXIT_GRACE_S
    while (left := {pid: cmd for pid, cmd in _running_children().items() if pid not in before}) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"the test left processes running: {left}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class TwoHosts:
    """Two network namespaces joined by a veth pair: host 0 at `addresses[0]`, host 1 at `addresses[1]`."""

    namespaces: tuple[str, str]
    devices: tuple[str, str]
    addresses: tuple[str, str] = ("10.213.0.1", "10.213.0.2")

    def start(self, host: int, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Run `python argv...` on `host`; its stderr is piped, for the test to show when it fails."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], sys.executable, *argv],
                                env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def link(self, state: str) -> None:
        """Take host 0's end of the cable "down" or bring it "up"."""
        _ip("-n", self.namespaces[0], "link", "set", self.devices[0], state)

    def reset_connections(self, host: int) -> int:
        """Abort every TCP connection `host` has to the other host, as a failing network device would (the
        reset reaches the other side only while the link is up); returns how many there were."""
        listing = subprocess.run(["ip", "netns", "exec", self.namespaces[host], "ss", "-K", "-H", "-t", "dst",
                                  self.addresses[1 - host]], check=True, capture_output=True, timeout=10, text=True)
        return len(listing.stdout.splitlines())


@pytest.fixture
def two_hosts() -> Iterator[TwoHosts]:
    """Two hosts for a test of the network between ranks; skips without root, `ip` and `ss`."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("ss") is None:
        pytest.skip("needs root, ip and ss to build two hosts from network namespaces")
    tag = str(os.getpid() % 100000)
    hosts = TwoHosts((f"shoal-a{tag}", f"shoal-b{tag}"), (f"sha{tag}", f"shb{tag}"))
    try:
        _ip("netns", "add", hosts.namespaces[0])
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"network namespaces are not available here: {exc.stderr.decode().strip()}")
    try:
        _ip("netns", "add", hosts.namespaces[1])
        _ip("link", "add", hosts.devices[0], "type", "veth", "peer", "name", hosts.devices[1])
        for ns, dev, address in zip(hosts.namespaces, hosts.devices, hosts.addresses, strict=True):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns in hosts.namespaces:  # a namespace takes its end of the veth pair with it, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)

