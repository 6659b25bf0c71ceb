"""SHOAL_SOCKET_IFNAME: ranks listen on, and their peers reach them by, the network interfaces it names, not the
one that reaches the store. Two hosts (network namespaces) joined by two or three cables: the store is reached
over the first, and every collective's bytes cross the second, or the second and third in turn.

The two-host tests need root and `ip netns` (the `two_hosts` fixture); they skip elsewhere."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from shoal.comm.rendezvous import interface_address, listen_addresses
from shoal.comm.transport.mesh import Transport
from tests.hosts import TwoHosts
from tests.processes import reaped

SCRIPT = Path(__file__).parent / "scripts" / "collectives_across_hosts.py"
STORE_PORT = 29500  # each host is a namespace of its own: no other process can hold this port there
NUMEL = 4 << 20  # 16 MiB of float32


def test_the_named_interface_gives_its_address() -> None:
    assert interface_address("lo") == "127.0.0.1"


def test_a_loopback_interface_is_refused_for_a_store_on_another_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_SOCKET_IFNAME", "lo")
    with pytest.raises(ValueError, match="SHOAL_SOCKET_IFNAME='lo' is a loopback interface, which ranks on other "
                                         "hosts cannot reach"):
        listen_addresses("192.0.2.1")


def test_ranks_of_a_store_on_loopback_stay_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_SOCKET_IFNAME", "nosuch0")  # set for a whole cluster, say; this job is on one host
    assert listen_addresses("127.0.0.1") == ["127.0.0.1"]


def test_an_interface_this_host_lacks_is_named_with_those_it_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(ValueError, match=r"SHOAL_SOCKET_IFNAME='nosuch0': this host has no network interface of "
                                         r"that name \(it has lo\b"):
        listen_addresses("192.0.2.1")


def _run(two_hosts: TwoHosts, tmp_path: Path, cables: list[tuple[str, str]]) -> list[dict]:
    """Run the collectives on the two hosts, one rank each, SHOAL_SOCKET_IFNAME naming `cables`' ends; check their
    results, and that the store's cable carried the store's traffic alone."""
    store_cable_before = two_hosts.sent(0, two_hosts.devices[0]) + two_hosts.sent(1, two_hosts.devices[1])
    two_hosts.run_ranks(
        [0, 1], lambda rank: [str(SCRIPT), str(rank), "2", two_hosts.addresses[0], str(STORE_PORT),
                              ",".join(cable[rank] for cable in [two_hosts.devices, *cables]), str(NUMEL),
                              str(tmp_path)],
        lambda rank: {"SHOAL_SECRET": "two-cables-test", "SHOAL_HOST_ID": f"host{rank}",
                      "SHOAL_SOCKET_IFNAME": ",".join(cable[rank] for cable in cables)}, tmp_path, timeout=120)
    results = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in range(2)]
    assert all(all(r["right"].values()) for r in results), results
    store_cable = two_hosts.sent(0, two_hosts.devices[0]) + two_hosts.sent(1, two_hosts.devices[1]) - store_cable_before
    assert store_cable < NUMEL * 4 / 16, f"{store_cable} bytes crossed the store's cable"
    return results


def test_collectives_cross_the_cable_of_the_named_interface(two_hosts: TwoHosts, tmp_path: Path) -> None:
    data = two_hosts.add_cable()
    results = _run(two_hosts, tmp_path, [data])
    nbytes = NUMEL * 4
    for collective, share in (("all_reduce", 1.0), ("all_gather", 0.5), ("reduce_scatter", 0.5)):
        for rank in range(2):
            sent = results[rank]["sent"][collective]
            on_data = sent[data[rank]] / (share * nbytes)
            assert 1.0 <= on_data <= 1.2, f"{collective}: rank {rank} sent {on_data:.2f}x its share over the data cable"


def test_a_pair_s_connections_take_the_named_cables_in_turn(two_hosts: TwoHosts, tmp_path: Path) -> None:
    cables = [two_hosts.add_cable(), two_hosts.add_cable(("10.215.0.1", "10.215.0.2"))]
    results = _run(two_hosts, tmp_path, cables)  # SHOAL_STREAMS unset: one connection a cable
    nbytes = NUMEL * 4
    for collective, share in (("all_reduce", 1.0), ("all_gather", 0.5), ("reduce_scatter", 0.5)):
        for rank in range(2):
            sent = results[rank]["sent"][collective]
            halves = [sent[cable[rank]] / (share * nbytes) for cable in cables]
            assert all(0.45 <= half <= 0.6 for half in halves), \
                f"{collective}: rank {rank} sent {halves} of its share over the two cables, not half over each"


_INIT = ("import sys\nfrom datetime import timedelta\nimport shoal.distributed as dist\n"
         "try:\n    dist.init_process_group('shoal', sys.argv[1], rank=int(sys.argv[2]), world_size=2, "
         "timeout=timedelta(seconds=30))\nexcept ValueError as exc:\n    print(exc)\n")


def test_ranks_naming_different_numbers_of_interfaces_are_all_told(two_hosts: TwoHosts, tmp_path: Path) -> None:
    data = two_hosts.add_cable()
    other = two_hosts.add_cable(("10.215.0.1", "10.215.0.2"))
    names = [f"{data[0]},{other[0]}", data[1]]
    procs = [two_hosts.start(rank, ["-c", _INIT, f"tcp://{two_hosts.addresses[0]}:{STORE_PORT}", str(rank)],
                             {"SHOAL_SECRET": "mismatch-test", "SHOAL_SOCKET_IFNAME": names[rank]},
                             stderr=subprocess.DEVNULL, stdout=subprocess.PIPE) for rank in range(2)]
    with reaped(procs):
        answers = [p.communicate(timeout=60)[0].decode() for p in procs]
    for rank, answer in enumerate(answers):
        assert f"rank {rank} listens on {2 - rank} address(es) (SHOAL_SOCKET_IFNAME), but rank {1 - rank} on " \
               f"{1 + rank}: every rank must name as many interfaces, one on each network" in answer, answer


def test_two_interfaces_of_one_address_are_refused(two_hosts: TwoHosts) -> None:
    first = two_hosts.add_cable()
    second = two_hosts.add_cable()  # the same addresses again
    probe = ("from shoal.comm.rendezvous import listen_addresses\n"
             "try:\n    listen_addresses('10.213.0.2')\nexcept ValueError as exc:\n    print(exc)\n")
    answer = subprocess.run(["ip", "netns", "exec", two_hosts.namespaces[0], sys.executable, "-c", probe],
                            env={**os.environ, "SHOAL_SOCKET_IFNAME": f"{first[0]},{second[0]}"},
                            check=True, capture_output=True, timeout=60, text=True).stdout
    assert f"SHOAL_SOCKET_IFNAME names {first[0]}, {second[0]}, which have one address, 10.214.0.1: name one " \
           f"interface on each network" in answer, answer


def test_a_rank_listens_on_one_port_at_each_of_its_addresses() -> None:
    transport = Transport(0, 1, secret=b"s", session=b"t", hosts=["127.0.0.1", "127.0.0.2"],
                          stall_timeout=timedelta(seconds=5))
    try:
        hosts, port = transport.address
        assert hosts == "127.0.0.1,127.0.0.2"
        for host in ("127.0.0.1", "127.0.0.2"):
            socket.create_connection((host, port), timeout=5).close()  # refused if nothing listened there
    finally:
        transport.close()


def test_an_interface_without_an_ipv4_address_is_named(two_hosts: TwoHosts) -> None:
    subprocess.run(["ip", "-n", two_hosts.namespaces[0], "link", "add", "bare0", "type", "veth", "peer", "name",
                    "bare1"], check=True, capture_output=True, timeout=10)
    probe = ("from shoal.comm.rendezvous import interface_address\n"
             "try:\n    interface_address('bare0')\nexcept ValueError as exc:\n    print(exc)\n")
    answer = subprocess.run(["ip", "netns", "exec", two_hosts.namespaces[0], sys.executable, "-c", probe],
                            check=True, capture_output=True, timeout=60, text=True).stdout
    assert "SHOAL_SOCKET_IFNAME='bare0': the interface has no IPv4 address" in answer
