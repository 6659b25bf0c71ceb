"""The `shoal run` launcher end to end: environment, rank-prefixed output, failure reports, restarts,
signals reaching every worker, two launchers forming one static multi-node job, an elastic job forming
without a launcher killed while it waited, the store it serves."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.elastic.launch_config import parse_args
from shoal.ports import free_port
from tests.processes import reaped
from tests.waiting import process_gone, wait_until

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "scripts"


def _launch(*args: str, timeout: float = 90, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal.run", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def test_workers_get_torchrun_environment_and_prefixed_output() -> None:
    result = _launch("--nproc_per_node", "2", str(SCRIPTS / "show_env.py"))
    assert result.returncode == 0, result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("[rank"))
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        assert line.startswith(f"[rank{rank}]: RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 "
                               f"MASTER_ADDR=127.0.0.1 MASTER_PORT="), line
    secrets = {line.split("SECRET=")[1].split()[0] for line in lines}
    assert len(secrets) == 1 and len(secrets.pop()) == 8  # one fresh secret, shared by the job
    assert all("TORCHELASTIC_RUN_ID=none " in line for line in lines)  # torchrun's default id


def test_torchruns_single_node_and_rendezvous_flags_are_taken() -> None:
    result = _launch("--standalone", "--rdzv-backend", "c10d", "--rdzv_id", "job7", "--nproc-per-node", "2",
                     str(SCRIPTS / "show_env.py"))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("[rank")]
    assert len(lines) == 2 and all("MASTER_ADDR=127.0.0.1 " in line and "TORCHELASTIC_RUN_ID=job7 " in line
                                   for line in lines), lines


def test_module_mode_passes_flags_through_to_the_module() -> None:
    # As with torchrun, everything after the module name belongs to the module, even launcher-like flags.
    result = _launch("--nproc-per-node", "1", "-m", "tests.scripts.show_env", "--epochs", "3", "--max-restarts", "2")
    assert result.returncode == 0, result.stderr
    assert "ARGS=['--epochs', '3', '--max-restarts', '2']" in result.stdout


def test_a_failing_worker_stops_the_job_and_is_reported() -> None:
    result = _launch("--nproc-per-node", "2", str(SCRIPTS / "fail_once.py"), "always")
    assert result.returncode != 0
    assert "rank 1 failed with exit code 3" in result.stderr, result.stderr
    assert "boom: simulated failure" in result.stderr  # the tail of its output
    assert "sum" not in result.stdout  # rank 0 was stopped, not left to finish


def test_max_restarts_restarts_every_worker() -> None:
    result = _launch("--nproc-per-node", "2", "--max-restarts", "1", str(SCRIPTS / "fail_once.py"))
    assert result.returncode == 0, result.stderr
    assert "restarting all workers" in result.stderr
    assert sorted(line for line in result.stdout.splitlines() if "sum" in line) == [
        "[rank0]: attempt 1 sum 6", "[rank1]: attempt 1 sum 6"]


def test_sigterm_reaches_every_worker_and_leaves_no_orphans(tmp_path: Path) -> None:
    launcher = subprocess.Popen([sys.executable, "-m", "shoal.run", "--nproc-per-node", "2",
                                 str(SCRIPTS / "sleep_and_record.py"), str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = 0
        for line in launcher.stdout:  # each worker says "ready" once its PID is on disk
            ready += "ready" in line
            if ready == 2:
                break
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) != 0
        for rank in range(2):  # the launcher passed the signal on: each worker's handler ran
            assert (tmp_path / f"got-sigterm{rank}").read_text() == "yes"
        for pid in pids:
            wait_until(lambda pid=pid: process_gone(pid), f"worker {pid} has exited", timeout=10, interval=0.1)
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_two_launchers_form_one_static_multi_node_job() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "shoal.run", "--nnodes", "2", "--node-rank", str(node),
                               "--rdzv-endpoint", endpoint, "--nproc-per-node", "2",
                               str(SCRIPTS / "all_reduce_sum.py")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={k: v for k, v in os.environ.items() if k != "SHOAL_SECRET"})
             for node in (0, 1)]
    try:
        outputs = [node.communicate(timeout=90)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0]
    assert "[rank0]: sum 10 of world 4" in outputs[0] and "[rank1]: sum 10 of world 4" in outputs[0]
    assert "[rank2]: sum 10 of world 4" in outputs[1] and "[rank3]: sum 10 of world 4" in outputs[1]


def test_a_launcher_killed_while_it_waits_for_min_nodes_is_left_out_of_the_job(tmp_path: Path) -> None:
    """`--nnodes 3:4`: the second launcher is killed while it waits for a third node; two more arrive,
    and the job forms with the three alive, whose workers all-reduce together."""
    endpoint = f"127.0.0.1:{free_port()}"
    procs: list[subprocess.Popen] = []

    def node(name: str) -> Path:
        out = tmp_path / f"{name}.out"
        with out.open("w") as sink:
            procs.append(subprocess.Popen([sys.executable, "-m", "shoal.run", "--nnodes", "3:4", "--rdzv-endpoint",
                                           endpoint, "--rdzv-conf", "last_call_timeout=1", "--nproc-per-node", "1",
                                           str(SCRIPTS / "all_reduce_sum.py")],
                                          stdout=sink, stderr=subprocess.STDOUT,
                                          env={k: v for k, v in os.environ.items() if k != "SHOAL_SECRET"}))
        return out

    with reaped(procs):
        first = node("first")
        wait_until(lambda: "node slot 0 is waiting" in first.read_text(), "the first launcher serves the store",
                   timeout=60, interval=0.05)  # the second finds the port taken and connects
        killed = node("killed")
        wait_until(lambda: "node slot 1 is waiting for 3 nodes" in killed.read_text(), "the second launcher waits",
                   timeout=60, interval=0.05)
        procs[1].kill()
        outs = [first, node("second"), node("third")]
        codes = [procs[i].wait(timeout=90) for i in (0, 2, 3)]
    outputs = [out.read_text() for out in outs]
    assert codes == [0, 0, 0], outputs
    sums = sorted(line for text in outputs for line in text.splitlines() if ": sum " in line)
    assert sums == [f"[rank{r}]: sum 6 of world 3" for r in range(3)], outputs
    assert "[rank0]: sum 6 of world 3" in outputs[0], outputs  # the first to arrive is node rank 0


def test_the_store_outlives_rank_0_because_the_launcher_serves_it() -> None:
    # Were rank 0 serving it, the store would have gone with rank 0's process.
    result = _launch("--nproc-per-node", "2", "-m", "tests.scripts.regroup_after_rank0_leaves",
                     cwd=ROOT)  # where -m finds tests.scripts
    assert result.returncode == 0, result.stderr
    assert "[rank1]: regrouped alone after rank 0 left: sum 2, note 'hello'" in result.stdout


def test_a_script_may_initialize_torch_distributed_beside_shoal_from_the_environment() -> None:
    # Both rendezvous read MASTER_ADDR:MASTER_PORT; neither tries to serve it, the launcher does.
    result = _launch("--nproc-per-node", "2", str(SCRIPTS / "torch_and_shoal_env.py"))
    assert result.returncode == 0, result.stderr
    assert sorted(line for line in result.stdout.splitlines() if "torch" in line) == [
        "[rank0]: torch 2 shoal 20", "[rank1]: torch 2 shoal 20"]


def test_under_live_a_worker_that_exits_with_an_error_still_fails_the_job() -> None:
    # Only a worker killed by a signal is lost (the others go on); an error is the script's.
    result = _launch("--live", "--nproc-per-node", "2", str(SCRIPTS / "fail_once.py"), "always")
    assert result.returncode != 0
    assert "rank 1 failed with exit code 3" in result.stderr, result.stderr
    assert "the others go on" not in result.stderr


def test_a_taken_store_port_is_reported_without_a_traceback() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = _launch("--master-port", str(taken.getsockname()[1]), str(SCRIPTS / "show_env.py"))
    assert result.returncode == 1
    assert "shoal run: rendezvous port" in result.stderr and "already in use" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1", "x.py"], "node-rank 2 is outside"),
    (["--nnodes", "2", "x.py"], "give every node the same --rdzv-endpoint"),
    (["--nnodes", "1:4", "x.py"], "the nodes agree on their ranks at the --rdzv-endpoint"),
    (["--nnodes", "1:4", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:1", "x.py"], "no --node-rank"),
    (["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf", "join_timeout=inf", "x.py"],
     "the value must be seconds"),
    (["--nnodes", "3:2", "--rdzv-endpoint", "127.0.0.1:1", "x.py"], "between 1 and MAX"),
    (["--nnodes", "one", "x.py"], "must be N or MIN:MAX"),
    (["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf", "read_timeout=3", "x.py"], "known keys are"),
    (["--nproc-per-node", "2"], "nothing to run"),
    (["--standalone", "--nnodes", "2", "x.py"], "--standalone runs one node"),
    (["--rdzv-backend", "etcd", "x.py"], "invalid choice: 'etcd'"),
    (["--max-restarts", "1", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "x.py"], "restart together"),
])
def test_bad_launcher_arguments_are_refused(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(args)
    assert exited.value.code == 2 and message in capsys.readouterr().err
