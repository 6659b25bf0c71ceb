"""No single point of failure: a `--live` job on two hosts (network namespaces) loses host 0, whose
launcher served the job's store and whose workers held rank 0; host 1's workers go on in the same
processes from the last committed step with the store's replica on host 1 as its primary, and a
replacement node that names host 1 as its endpoint joins them. Every sample is trained once.

Needs root and `ip netns` (the `two_hosts` fixture); skips elsewhere."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from tests.hosts import TwoHosts
from tests.live_reports import assert_alike, states
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
PORT = 29500  # each host is a namespace of its own: no other process holds this port there
# Kills are seen as closed connections; a long heartbeat keeps a loaded machine's pauses from looking like losses.
ENV = {"SHOAL_SECRET": "store-failover-test", "SHOAL_SHM": "0", "SHOAL_HEARTBEAT_TIMEOUT": "30"}


def test_the_job_survives_the_node_that_served_its_store_and_a_replacement_joins(two_hosts: TwoHosts,
                                                                               tmp_path: Path) -> None:
    hosts = two_hosts
    logs: list[tuple[subprocess.Popen, Path]] = []

    def node(host: int, endpoint_host: int, name: str, *script: str) -> subprocess.Popen:
        out = tmp_path / f"{name}.out"
        with out.open("w") as sink:
            proc = hosts.start(host, ["-m", "shoal.run", "--nnodes", "1:2", "--nproc-per-node", "2", "--live",
                                      "--rdzv-endpoint", f"{hosts.addresses[endpoint_host]}:{PORT}", "--rdzv-id",
                                      "failover", "-m", "tests.scripts.live_train", "--epochs", "2", *script],
                               ENV, stderr=subprocess.STDOUT, stdout=sink, cwd=str(ROOT))
        logs.append((proc, out))
        return proc

    # Host 0's launcher (the store's first primary) is killed before step 4; its workers die with it.
    # Short of four workers, host 1's wait for workers to join before they go on.
    script = ("--min-workers", "4")
    first, second = node(0, 0, "host0", *script, "--kill-launcher", "0:4"), node(1, 0, "host1", *script)
    try:
        wait_until(lambda: first.poll() is not None or second.poll() is not None, "host 0's launcher is killed",
                   timeout=120, interval=0.1)
        assert first.returncode == -signal.SIGKILL, logs[0][1].read_text()
        assert second.poll() is None, logs[1][1].read_text()
        replacement = node(0, 1, "replacement", *script)  # host 0 again, a new node: host 1 is the endpoint now
        codes = [second.wait(timeout=150), replacement.wait(timeout=150)]
    finally:
        for proc, _ in logs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = [out.read_text() for _, out in logs]
    assert codes == [0, 0], outputs
    reports, finals = states("\n".join(outputs))
    assert_alike(reports, finals)
    assert reports["0"][0][1].split()[:2] == ["4", "0"], reports
    last = reports[max(reports, key=int)]  # host 1's pair and the replacement's, from step 4: the last committed
    assert last[0][1].split()[:2] == ["4", "4"] and {who for who, _ in last} == {f"[rank{r}]" for r in (2, 3, 4, 5)}
    assert sorted(finals) == ["[rank2]", "[rank3]", "[rank4]", "[rank5]"], finals
    # A member's ledger holds every member's samples of the steps it was there for: the survivors', all of them.
    assert all(finals[f"[rank{r}]"].startswith("samples 122 missing 0 twice 0 ") for r in (2, 3)), finals
    assert all(" twice 0 " in finals[f"[rank{r}]"] for r in (4, 5)), finals
