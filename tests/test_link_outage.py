"""Two ranks on two hosts (network namespaces joined by a veth pair) while the link between them goes
down: a short outage, even one that resets the connection, heals and every all-reduce comes out right;
an outage longer than the heal and heartbeat deadlines ends in PeerFailure on both sides, not a hang.
With two cables, both named by SHOAL_SOCKET_IFNAME, the connection on the second heals on it, or over the
first while the second stays down, and moves back once it is up.

Needs root and `ip netns` (the `two_hosts` fixture); skips elsewhere."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.hosts import TwoHosts
from tests.waiting import wait_until

SCRIPT = Path(__file__).parent / "scripts" / "all_reduce_until_stopped.py"
STORE_PORT = 29500  # each host is a namespace of its own: no other process can hold this port there
_SECOND_ADDRESSES = ("10.214.0.1", "10.214.0.2")  # the hosts' ends of a second cable


def _progress(workdir: Path) -> int:
    """Rounds both ranks have finished."""
    counts = []
    for rank in (0, 1):
        try:
            counts.append(int((workdir / f"progress{rank}").read_text()))
        except FileNotFoundError:  # not yet written
            counts.append(0)
    return min(counts)


def _or_a_rank_ends(condition: Callable[[], bool], ranks: list[subprocess.Popen]) -> Callable[[], bool]:
    """`condition`, or any rank has ended: a wait stops at once then (the rank's result says how)."""
    return lambda: condition() or any(p.poll() is not None for p in ranks)


def _run_outage(hosts: TwoHosts, workdir: Path, *, down_s: float | None, reset: int | None, env: dict[str, str],
                second: tuple[str, str] | None = None) -> tuple[int, list[dict], dict[str, int]]:
    """Run rank r on host r, take the link down for `down_s` once they are under way (resetting host `reset`'s
    connections meanwhile), and let them finish. With `second`, a second cable's ends, the ranks talk over both
    cables and the outage is the second's; with `down_s` None it lasts until the rounds after it are counted,
    and the second cable must then carry 1 MiB from host 0 again before the ranks stop. Returns (rounds before
    the outage, results, the bytes host 0 sent over each cable's end after the outage)."""
    env = {"SHOAL_SECRET": "link-outage-test", "SHOAL_SHM": "0", **env}  # hosts share no memory
    logs = [open(workdir / f"stderr{rank}", "wb") for rank in (0, 1)]  # closed below
    envs = [env, env]
    if second is not None:
        envs = [{**env, "SHOAL_SOCKET_IFNAME": f"{hosts.devices[rank]},{second[rank]}"} for rank in (0, 1)]
    cable = hosts.devices[0] if second is None else second[0]
    ends = [hosts.devices[0]] + ([] if second is None else [second[0]])
    ranks = [hosts.start(rank, [str(SCRIPT), str(rank), hosts.addresses[0], str(STORE_PORT), str(workdir)],
                         envs[rank], logs[rank]) for rank in (0, 1)]
    try:
        wait_until(_or_a_rank_ends(lambda: _progress(workdir) >= 3, ranks),
                   "both ranks have finished three rounds before the outage, or one has ended", timeout=60,
                   interval=0.05)
        hosts.link("down", cable)
        # Counted once the cable is down: rounds are quick, and several may finish while `ip` takes it down. Of
        # the rounds after this count, the first may have finished before its progress was written, and the
        # second been under way on what had crossed.
        before = _progress(workdir)
        sent_before = {end: hosts.sent(0, end) for end in ends}
        if reset is not None:  # the rendezvous store's connection is spared: it is not shoal's transport
            to = None if second is None else _SECOND_ADDRESSES[1 - reset]
            assert hosts.reset_connections(reset, spare_port=STORE_PORT, to=to) >= 1, "no connection to reset"
        if down_s is not None:
            time.sleep(down_s)
            hosts.link("up", cable)
        wait_until(_or_a_rank_ends(lambda: _progress(workdir) >= before + 6, ranks),
                   "both ranks have finished six rounds after the outage, or one has ended", timeout=60,
                   interval=0.05)
        sent_after = {end: hosts.sent(0, end) - sent_before[end] for end in ends}
        if down_s is None and second is not None:
            hosts.link("up", cable)
            back_at = hosts.sent(0, cable)
            wait_until(_or_a_rank_ends(lambda: hosts.sent(0, cable) - back_at >= 1 << 20, ranks),
                       "the second cable carries 1 MiB again once it is back, or a rank has ended", timeout=30,
                       interval=0.05)
        (workdir / "stop").touch()
        for p in ranks:
            p.wait(timeout=60)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    for rank, p in enumerate(ranks):
        assert p.returncode == 0, (rank, p.returncode, (workdir / f"stderr{rank}").read_text()[-3000:])
    return before, [json.loads((workdir / f"result{r}.json").read_text()) for r in (0, 1)], sent_after


@pytest.mark.parametrize("reset", [None, 0, 1], ids=["no-reset", "reset-on-the-listening-side",
                                                     "reset-on-the-dialling-side"])
def test_a_one_second_outage_heals(two_hosts: TwoHosts, tmp_path: Path, reset: int | None) -> None:
    # Heartbeats are not what this test is about: give the heal room on a busy machine.
    before, results, _ = _run_outage(two_hosts, tmp_path, down_s=1.0, reset=reset,
                                     env={"SHOAL_HEARTBEAT_TIMEOUT": "10"})
    for rank, result in enumerate(results):
        assert result["outcome"] == "stopped", (rank, result)
        assert result["rounds"] >= before + 6, (rank, result, before)


@pytest.mark.parametrize("reset", [0, 1], ids=["reset-on-the-listening-side", "reset-on-the-dialling-side"])
def test_the_second_cable_s_connection_heals_on_it(two_hosts: TwoHosts, tmp_path: Path, reset: int) -> None:
    second = two_hosts.add_cable(_SECOND_ADDRESSES)
    # Half a second down: back well before a redial would try the first cable (connecting.py, _FAILOVER_AFTER_S).
    before, results, sent_after = _run_outage(two_hosts, tmp_path, down_s=0.5, reset=reset,
                                              env={"SHOAL_HEARTBEAT_TIMEOUT": "10"}, second=second)
    for rank, result in enumerate(results):
        assert result["outcome"] == "stopped", (rank, result)
        assert result["rounds"] >= before + 6, (rank, result, before)
    # Each round's all-reduce of 1 MiB sends 1 MiB each way, half of it over each cable; of the six rounds
    # counted, the last four crossed wholly after the count began: 2 MiB over the second cable, of which 1.25
    # is ample.
    assert sent_after[second[0]] >= 5 * (256 << 10), f"{sent_after} bytes crossed the cables after the outage"


def test_a_cable_down_a_while_leaves_its_connection_to_the_other_until_it_is_back(two_hosts: TwoHosts,
                                                                                  tmp_path: Path) -> None:
    second = two_hosts.add_cable(_SECOND_ADDRESSES)
    # No reset: the second cable's connection falls silent while the first's is heard, and is dialled again
    # over the first once the second stays down (shoal/comm/transport/connecting.py, _FAILOVER_AFTER_S); once
    # the second is back, the connection moves back to it (`_run_outage` waits for its bytes there).
    before, results, sent_after = _run_outage(two_hosts, tmp_path, down_s=None, reset=None, env={}, second=second)
    for rank, result in enumerate(results):
        assert result["outcome"] == "stopped", (rank, result)
        assert result["rounds"] >= before + 6, (rank, result, before)
    # Of the six rounds counted, the last four's 1 MiB each way, all over the first cable.
    assert sent_after[two_hosts.devices[0]] >= 4 << 20, f"{sent_after} bytes crossed the cables after the outage"


def test_an_outage_past_the_deadlines_is_a_peer_failure_on_both_sides(two_hosts: TwoHosts, tmp_path: Path) -> None:
    _, results, _ = _run_outage(two_hosts, tmp_path, down_s=5.0, reset=0,
                             env={"SHOAL_HEAL_TIMEOUT": "2", "SHOAL_HEARTBEAT_TIMEOUT": "2"})
    for rank, result in enumerate(results):
        assert result["outcome"].startswith(f"PeerFailure: rank {1 - rank}"), (rank, result)
