"""Four ranks on two hosts (network namespaces joined by a veth pair, SHOAL_HOST_ID naming each
namespace's host): ranks of a host share memory, and the hierarchical all-reduce, all-gather and
reduce-scatter cross the cable with each host's share once, where a flat ring of four would cross it one
and a half times.

Needs root and `ip netns` (the `two_hosts` fixture); skips elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

from tests.hosts import TwoHosts

SCRIPT = Path(__file__).parent / "scripts" / "collectives_across_hosts.py"
STORE_PORT = 29500  # each host is a namespace of its own: no other process can hold this port there
NUMEL = 4 << 20  # 16 MiB of float32


def test_hierarchical_collectives_send_each_hosts_share_across_the_cable_once(
        two_hosts: TwoHosts, tmp_path: Path) -> None:
    hosts = [0, 0, 1, 1]
    two_hosts.run_ranks(
        hosts, lambda rank: [str(SCRIPT), str(rank), "4", two_hosts.addresses[0], str(STORE_PORT),
                             two_hosts.devices[hosts[rank]], str(NUMEL), str(tmp_path)],
        lambda rank: {"SHOAL_SECRET": "two-hosts-test", "SHOAL_HOST_ID": f"host{hosts[rank]}"}, tmp_path, timeout=120)
    results = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in range(4)]
    assert all(all(r["right"].values()) and r["hosts"] == [[0, 1], [2, 3]] for r in results), results
    nbytes = NUMEL * 4
    # Each host's first rank reads its end of the cable. An all-reduce must send the other host the whole tensor
    # (its host's sums), an all-gather its host's half of the output, a reduce-scatter its host's sums of the
    # other host's half of the input: a flat ring sends 1.5x those.
    for collective, share in (("all_reduce", 1.0), ("all_gather", 0.5), ("reduce_scatter", 0.5)):
        for leader in (0, 2):
            sent = results[leader]["sent"][collective][two_hosts.devices[hosts[leader]]] / (share * nbytes)
            assert 1.0 <= sent <= 1.2, f"{collective}: host {leader // 2} sent {sent:.2f}x its share across"
