"""Fixtures shared by the test files: a guard that fails any test leaving a child process running, and
two hosts built from network namespaces for tests of the network between ranks."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import pytest

from tests.hosts import TwoHosts, namespaces_missing
from tests.waiting import wait_until

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
def leaves_no_child_process_behind() -> Iterator[None]:
    """Every test cleans up the processes it starts: a child still running after the test (and a short
    grace for those on their way out) is killed, and the test fails naming it."""
    if not os.path.isdir("/proc/self"):
        yield
        return
    before = set(_running_children())
    yield

    def started_here() -> dict[int, str]:
        return {pid: cmd for pid, cmd in _running_children().items() if pid not in before}

    with contextlib.suppress(TimeoutError):  # whatever still runs then is killed and named below
        wait_until(lambda: not started_here(), "the test's child processes have exited", timeout=_EXIT_GRACE_S,
                   interval=0.05)
    left = started_here()
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"the test left processes running: {left}"


@pytest.fixture
def two_hosts() -> Iterator[TwoHosts]:
    """Two hosts for a test of the network between ranks; skips, saying why, where they cannot be built."""
    missing = namespaces_missing()
    if missing:
        pytest.skip(missing)
    hosts = TwoHosts.build()
    try:
        yield hosts
    finally:
        hosts.tear_down()
