"""SHOAL_SOCKET_IFNAME: ranks listen on, and their peers reach them by, the network interface it names, not the
one that reaches the store. Two hosts (network namespaces) joined by two cables: the store is reached over
the first, and every collective's bytes cross the second.

The two-host tests need root and `ip netns` (the `two_hosts` fixture); they skip elsewhere."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.comm.rendezvous import interface_address, listen_address
from tests.hosts import TwoHosts

SCRIPT = Path(__file__).parent / "scripts" / "collectives_across_hosts.py"
STORE_PORT = 29500  # each host is a namespace of its own: no other process can hold this port there
NUMEL = 4 << 20  # 16 MiB of float32


def test_the_named_interface_gives_its_address() -> None:
    assert interface_address("lo") == "127.0.0.1"


def test_a_loopback_interface_is_refused_for_a_store_on_another_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_SOCKET_IFNAME", "lo")
    with pytest.raises(ValueError, match="SHOAL_SOCKET_IFNAME='lo' is a loopback interface, which ranks on other "
                                         "hosts cannot reach"):
        listen_address("192.0.2.1")


def test_ranks_of_a_store_on_loopback_stay_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_SOCKET_IFNAME", "nosuch0")  # set for a whole cluster, say; this job is on one host
    assert listen_address("127.0.0.1") == "127.0.0.1"


def test_an_interface_this_host_lacks_is_named_with_those_it_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(ValueError, match=r"SHOAL_SOCKET_IFNAME='nosuch0': this host has no network interface of "
                                         r"that name \(it has lo\b"):
        listen_address("192.0.2.1")


def test_collectives_cross_the_cable_of_the_named_interface(two_hosts: TwoHosts, tmp_path: Path) -> None:
    data = two_hosts.add_cable()
    store_cable_before = two_hosts.sent(0, two_hosts.devices[0]) + two_hosts.sent(1, two_hosts.devices[1])
    two_hosts.run_ranks(
        [0, 1], lambda rank: [str(SCRIPT), str(rank), "2", two_hosts.addresses[0], str(STORE_PORT), data[rank],
                              str(NUMEL), str(tmp_path)],
        lambda rank: {"SHOAL_SECRET": "two-cables-test", "SHOAL_HOST_ID": f"host{rank}",
                      "SHOAL_SOCKET_IFNAME": data[rank]}, tmp_path, timeout=120)
    results = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in range(2)]
    assert all(all(r["right"].values()) for r in results), results
    nbytes = NUMEL * 4
    for collective, share in (("all_reduce", 1.0), ("all_gather", 0.5), ("reduce_scatter", 0.5)):
        for rank in range(2):
            sent = results[rank]["sent"][collective] / (share * nbytes)
            assert 1.0 <= sent <= 1.2, f"{collective}: rank {rank} sent {sent:.2f}x its share over the second cable"
    store_cable = two_hosts.sent(0, two_hosts.devices[0]) + two_hosts.sent(1, two_hosts.devices[1]) - store_cable_before
    assert store_cable < nbytes / 16, f"{store_cable} bytes crossed the store's cable"


def test_an_interface_without_an_ipv4_address_is_named(two_hosts: TwoHosts) -> None:
    subprocess.run(["ip", "-n", two_hosts.namespaces[0], "link", "add", "bare0", "type", "veth", "peer", "name",
                    "bare1"], check=True, capture_output=True, timeout=10)
    probe = ("from shoal.comm.rendezvous import interface_address\n"
             "try:\n    interface_address('bare0')\nexcept ValueError as exc:\n    print(exc)\n")
    answer = subprocess.run(["ip", "netns", "exec", two_hosts.namespaces[0], sys.executable, "-c", probe],
                            check=True, capture_output=True, timeout=60, text=True).stdout
    assert "SHOAL_SOCKET_IFNAME='bare0': the interface has no IPv4 address" in answer
