"""Live recovery end to end: a worker killed at some step, the others (the same processes) go on in
the next generation and finish the epoch; every sample is trained exactly once, and the survivors'
parameters equal a replay of the committed steps in one process."""

from __future__ import annotations

import collections
import os
import random
import re
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

from shoal.comm.store import Store
from shoal.data import ElasticSampler
from shoal.elastic.live import LiveTraining
from shoal.ports import free_port
from tests.live_reports import assert_alike, live_data, replay, states
from tests.processes import reaped
from tests.ranks import run_ranks
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
SAMPLES, BATCH, SEED = 61, 2, 1
# The kills here are seen when the kernel closes the sockets; a long heartbeat keeps a loaded machine's
# pauses from looking like a loss, which would change the generations the tests expect.
QUIET = {"SHOAL_HEARTBEAT_TIMEOUT": "30"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(6, 3).double()


def _train(rank: int, world: int, _: int, store_port: int, victim: int | None, lost_at: int) -> tuple:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port),
                      TORCHELASTIC_USE_AGENT_STORE="True", SHOAL_LIVE="1")  # as `shoal run --live` sets them
    data, model = live_data(SAMPLES), _model()
    sampler = ElasticSampler(data, BATCH, rank=rank, world_size=world, seed=SEED)
    live = LiveTraining(model, torch.optim.SGD(model.parameters(), lr=0.1), sampler, timeout=timedelta(seconds=30))
    ledger = []  # per committed step: where it starts and ends in the epoch's order, and how many took part
    for x, y in live.batches(torch.utils.data.DataLoader(data, batch_sampler=sampler)):
        if rank == victim and live.steps == lost_at:
            os.kill(os.getpid(), signal.SIGKILL)
        start = sampler.offset
        with live.step() as step:
            nn.functional.cross_entropy(live.model(x), y).backward()
        if step.committed:
            ledger.append((start, sampler.offset, live.generation.size))
    live.close()
    return ledger, [p.detach().clone() for p in model.parameters()], live.generation.number


def _replay(ledger: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    model = _model()
    return replay(ledger, live_data(SAMPLES), model, torch.optim.SGD(model.parameters(), lr=0.1), SEED)


@pytest.mark.parametrize(("victim", "lost_at"), [(None, 0), (1, 3), (0, 6)],
                         ids=["no loss", "rank 1 killed at step 3", "rank 0 killed at step 6"])
def test_survivors_finish_the_epoch_with_every_sample_once(victim: int | None, lost_at: int) -> None:
    store = Store.connect("127.0.0.1", 0, world_size=1, is_server=True)  # the launcher's
    out = run_ranks(_train, 3, store.raw.port, victim, lost_at, backend=None, timeout=90,
                    expect={victim: "dies"} if victim is not None else None, env=QUIET)
    survivors = [r for r in range(3) if r != victim]
    ledger, params, generation = out[survivors[0]]
    for rank in survivors[1:]:
        assert out[rank][0] == ledger and out[rank][2] == generation
        assert all(torch.equal(a, b) for a, b in zip(out[rank][1], params, strict=True))
    assert generation == (0 if victim is None else 1)
    assert [start for start, _, _ in ledger] == [0] + [stop for _, stop, _ in ledger[:-1]]  # no gap, no overlap
    assert ledger[-1][1] == SAMPLES
    for got, want in zip(params, _replay(ledger), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def _launch_live(*args: str, restarts: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal.run", "--live", "--max-restarts", str(restarts),
                           "--nproc-per-node", "3", "-m", "tests.scripts.live_train", *args],
                          capture_output=True, text=True, timeout=180, env=dict(os.environ, **QUIET),
                          cwd=ROOT)  # where -m finds tests.scripts


def test_under_the_launcher_the_others_go_on_and_the_job_succeeds() -> None:
    """The worker started in the lost one's place nearly always arrives after the others finished (three
    steps after the kill; importing torch takes far longer): it ends with status 0. If it arrives in
    time, it joins; either way the job succeeds with every sample once."""
    result = _launch_live("--kill", "1:8", restarts=1)
    assert result.returncode == 0, result.stderr
    assert "rank 1 was lost (signal 9); the others go on without it (--live)" in result.stderr
    reports, finals = states(result.stdout)
    assert_alike(reports, finals)
    assert finals["[rank0]"].startswith("samples 61 missing 0 twice 0 generation ")
    if "[rank1]: shoal: the others finished the job before this worker could join it" in result.stdout:
        assert sorted(finals) == ["[rank0]", "[rank2]"]
        assert " generation 1 of 2 steps " in finals["[rank0]"]


@pytest.mark.parametrize("sharded", [False, True], ids=["DDP", "fully_shard"])
def test_a_lost_worker_started_again_joins_between_steps_with_the_others_state(sharded: bool) -> None:
    """The survivors go on without the lost worker, and admit the new one after a committed step: it
    receives the state after the script's own code for that step (its scheduler step) has run. Under
    fully_shard the survivors re-cut the model from the lost worker's buddy, and the joiner receives its rows."""
    result = _launch_live("--kill", "1:4", "--epochs", "3", "--await-joiner", *["--shard"] * sharded, restarts=1)
    assert result.returncode == 0, result.stderr
    assert "starting a new rank 1 to join them (restart 1 of 1)" in result.stderr
    reports, finals = states(result.stdout)
    assert_alike(reports, finals)
    assert sorted(entries[0][1].split()[:2] for entries in reports.values()) == [["2", "4"], ["3", "0"], ["3", "5"]]
    assert sorted(finals) == ["[rank0]", "[rank1]", "[rank2]"]
    assert finals["[rank0]"].startswith("samples 183 missing 0 twice 0 ")  # rank 0 was there from the start


def test_powersgd_goes_on_through_a_loss_and_a_joiner_projects_as_the_others_do() -> None:
    """Under PowerSGD, the joiner takes rank 0's step count, random generator and factors with the rest of
    the state: the replicas stay equal (a joiner that began its own count would average whole gradients
    while the others send factors)."""
    result = _launch_live("--kill", "1:4", "--epochs", "3", "--await-joiner", "--powersgd", restarts=1)
    assert result.returncode == 0, result.stderr
    reports, finals = states(result.stdout)
    assert_alike(reports, finals)
    assert sorted(finals) == ["[rank0]", "[rank1]", "[rank2]"]
    assert finals["[rank0]"].startswith("samples 183 missing 0 twice 0 ")


@pytest.mark.parametrize("optimizer", ["--diloco", "--post-local-sgd"])
def test_a_periodic_optimizer_undoes_the_period_a_worker_was_lost_in_and_admits_its_successor(optimizer: str) -> None:
    """Rank 1 is killed before step 4, in the period of steps 3-5: the survivors find it lost when they
    synchronize, undo the period on both (parameters, optimizers, steps, scheduler) back to the state they
    made final at step 3, and train it again; the worker started in its place joins at the next period's
    end. Every sample is trained once, in periods made final."""
    result = _launch_live("--kill", "1:4", "--epochs", "3", "--await-joiner", optimizer, restarts=1)
    assert result.returncode == 0, result.stderr
    reports, finals = states(result.stdout)
    assert_alike(reports, finals)
    assert sorted(entries[0][1].split()[:2] for entries in reports.values()) == [["2", "3"], ["3", "0"], ["3", "6"]]
    made_final = set(re.findall(r"\[rank[02]\]: final 3 state (\w+)", result.stdout))
    assert made_final == {reports["1"][0][1].split()[2]}, (made_final, reports["1"])
    assert sorted(finals) == ["[rank0]", "[rank1]", "[rank2]"]
    steps = re.search(r" steps (\d+) ", finals["[rank0]"])[1]
    assert finals["[rank0]"].startswith("samples 183 missing 0 twice 0 ")
    assert finals["[rank0]"].endswith(f" scheduler {steps}")  # undone with the period: stepped once a step
    assert f" steps {steps} counted {steps} " in finals["[rank0]"]  # and so is the optimizer's own count


def test_with_min_workers_the_survivors_wait_for_each_lost_worker_started_again() -> None:
    """Two kills, each followed by a worker that the launcher starts in the lost one's place; with
    min_workers 3 the survivors wait for it, so it joins at the step where the loss happened."""
    result = _launch_live("--kill", "1:4", "--kill", "2:30", "--epochs", "4", "--min-workers", "3", restarts=2)
    assert result.returncode == 0, result.stderr
    for rank, restart in ((1, 1), (2, 2)):
        assert f"rank {rank} was lost (signal 9); the others go on without it (--live)" in result.stderr
        assert f"starting a new rank {rank} to join them (restart {restart} of 2)" in result.stderr
    assert "rank 0 was lost" not in result.stderr and "starting a new rank 0" not in result.stderr
    assert "fewer than min_workers=3; waiting up to 60s for workers to join" in result.stdout
    reports, finals = states(result.stdout)
    assert_alike(reports, finals)
    assert sorted(entries[0][1].split()[:2] for entries in reports.values()) == [["3", "0"], ["3", "30"], ["3", "4"]]
    assert sorted(finals) == ["[rank0]", "[rank1]", "[rank2]"]
    assert finals["[rank0]"].startswith("samples 244 missing 0 twice 0 ")


def test_the_loop_from_the_docs_counts_committed_steps_only_under_kills_at_random_steps() -> None:
    """docs/training.md's loop (tests/scripts/live_train.py: a scheduler and a per-step log under
    `if step.committed:`), two workers killed at random steps and started again: the members' logs of
    what each committed step trained list every sample of every epoch exactly once, and every scheduler
    stepped once per committed step."""
    rng = random.Random()
    victims = rng.sample(range(3), 2)
    first = rng.randrange(2, 16)
    kills = [f"{victims[0]}:{first}", f"{victims[1]}:{rng.randrange(first + 3, 30)}"]
    result = _launch_live("--kill", kills[0], "--kill", kills[1], "--epochs", "3", restarts=2)
    assert result.returncode == 0, f"kills {kills}: {result.stderr}"
    trained = collections.Counter()
    for line in result.stdout.splitlines():
        _, _, text = line.partition(": ")
        if text.startswith("trained "):
            epoch, *indices = map(int, text.split()[1:])
            trained.update((epoch, i) for i in indices)
    assert trained == {(epoch, i): 1 for epoch in range(3) for i in range(SAMPLES)}, f"kills {kills}"
    _, finals = states(result.stdout)
    assert finals, result.stdout
    for text in finals.values():
        fields = text.split()
        assert fields[fields.index("scheduler") + 1] == fields[fields.index("steps") + 1], f"kills {kills}: {text}"


def test_a_worker_that_missed_a_training_joins_the_next_one_in_the_same_script(tmp_path: Path) -> None:
    """tests/scripts/live_two_trainings.py: the worker started in place of one lost in the first of two
    trainings arrives after the others closed it; it passes through that one, and the second (which
    begins with the first one's last members) admits it, every sample of it trained once."""
    result = subprocess.run([sys.executable, "-m", "shoal.run", "--live", "--max-restarts", "1", "--nproc-per-node",
                             "3", "-m", "tests.scripts.live_two_trainings", "--closed", str(tmp_path / "closed")],
                            capture_output=True, text=True, timeout=180, env=dict(os.environ, **QUIET),
                            cwd=ROOT)  # where -m finds tests.scripts
    assert result.returncode == 0, result.stderr
    assert "[rank2]: training 0 missed" in result.stdout
    lines = [line.split(": ", 1) for line in result.stdout.splitlines() if ": training " in line]
    firsts = {who: text.split(" steps ")[0] for who, text in lines if text.startswith("training 0 samples")}
    assert firsts == {f"[rank{r}]": "training 0 samples 61 twice 0 generation 1 of 2" for r in (0, 1)}
    seconds = {who: text for who, text in lines if text.startswith("training 1 samples")}
    assert sorted(seconds) == ["[rank0]", "[rank1]", "[rank2]"]
    assert len(set(seconds.values())) == 1, seconds
    assert seconds["[rank0]"].startswith("training 1 samples 122 twice 0 generation 1 of 3 "), seconds


def test_live_training_refuses_to_start_where_a_loss_would_stop_everyone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("SHOAL_LIVE", "0")  # `shoal run` without --live
    with pytest.raises(RuntimeError, match=r"shoal run --live"):
        LiveTraining(_model(), torch.optim.SGD(_model().parameters(), lr=0.1),
                     ElasticSampler(live_data(SAMPLES), BATCH, rank=0, world_size=1))


def test_the_demo_with_live_recovery_keeps_going_after_a_kill_and_the_lost_worker_rejoins() -> None:
    """The demo's worker as `shoal demo --live --workers 3 --min-workers 3` launches it, rank 1 killed
    after step 20 (tests/faults.py)."""
    command = [sys.executable, "-m", "shoal.run", "--live", "--max-restarts", "3", "--nproc-per-node", "3",
               "-m", "tests.scripts.demo_with_kill", "--kill-at", "1:20",
               "--live", "--epochs", "10", "--min-workers", "3"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=dict(os.environ, **QUIET),
                            cwd=ROOT)  # where -m finds tests.scripts
    assert result.returncode == 0, result.stderr
    assert "rank 1 was lost (signal 9); the others go on without it" in result.stderr
    assert "starting a new rank 1 to join them (restart 1 of 3)" in result.stderr
    last = re.search(r"epoch 10: test accuracy ([\d.]+)%, 3 workers \(generation (\d+)\)", result.stdout)
    assert last is not None, result.stdout
    assert float(last[1]) >= 95 and int(last[2]) >= 2  # lost, then joined
    assert "samples trained: 14370 over 10 epochs; missed 0, trained more than once per epoch 0" in result.stdout


def test_a_node_that_arrives_later_joins_the_job_and_a_lost_node_is_dropped(tmp_path: Path) -> None:
    """Elastic nodes (`--nnodes 2:3`, one worker each): two form the job, a third arrives later and its
    worker joins it live; then that node's launcher is killed (its worker dies with it), and the first
    two finish without it, every sample trained once."""
    endpoint = f"127.0.0.1:{free_port()}"
    script = ["-m", "tests.scripts.live_train", "--epochs", "2"]

    def node(name: str, *args: str) -> tuple[subprocess.Popen, Path]:
        out = tmp_path / f"{name}.out"
        command = [sys.executable, "-m", "shoal.run", "--nnodes", "2:3", "--nproc-per-node", "1", "--live",
                   "--rdzv-endpoint", endpoint, "--rdzv-id", "grow", *script, *args]
        with out.open("w") as sink:
            return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ, **QUIET),
                                    cwd=ROOT), out  # where -m finds tests.scripts

    # The first two wait between steps, while short of three workers, until the third asks to join.
    nodes = [node(name, "--await-joiner", "--full-size", "3") for name in ("a", "b")]

    def formed() -> bool:
        if any("generation 0 of 2 step 0" in out.read_text() for _, out in nodes):
            return True
        assert all(proc.poll() is None for proc, _ in nodes), [out.read_text() for _, out in nodes]
        return False

    with reaped([proc for proc, _ in nodes]) as procs:
        wait_until(formed, "the first two nodes have formed the job", timeout=90, interval=0.1)
        nodes.append(node("c", "--kill-launcher", "2:10"))  # slot 2: the node's only worker has launch rank 2
        procs.append(nodes[-1][0])
        codes = [proc.wait(timeout=150) for proc in procs]
    outputs = [out.read_text() for _, out in nodes]
    assert codes == [0, 0, -signal.SIGKILL], outputs
    # Every node keeps a replica of the store, so none waits for the killed node to fall silent to end.
    assert not any("serves the job's store until" in text for text in outputs), outputs
    reports, finals = states("\n".join(outputs))
    assert_alike(reports, finals)
    assert sorted(entries[0][1].split()[:2] for entries in reports.values()) == [["2", "0"], ["2", "10"], ["3", "1"]]
    assert sorted(finals) == ["[rank0]", "[rank1]"]
    assert all(text.startswith("samples 122 missing 0 twice 0 ") for text in finals.values()), finals
