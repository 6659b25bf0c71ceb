"""Observability end to end: the demo and a pipeline traced under the launcher, the merged timeline,
its summary and picture, metrics lines, plain progress in a log, and the flight records of a job with
a stuck rank naming that rank."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.observe import events
from shoal.observe.hang import diagnose
from shoal.observe.progress import progress
from shoal.observe.summary import intersection, rank_summary, union
from shoal.observe.timeline import Timeline
from shoal.observe.traces import read_events

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "scripts"


def shoal(*args: str, timeout: float = 100, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=ROOT)


def test_the_traced_demo_gives_timelines_a_summary_a_picture_metrics_and_plain_progress(tmp_path):
    trace, metrics = tmp_path / "trace", tmp_path / "metrics.jsonl"
    run = shoal("demo", "--workers", "2", "--epochs", "2", "--trace", str(trace), "--metrics", str(metrics),
                env={"SHOAL_PROGRESS_EVERY_S": "0"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # Output into a pipe: plain progress lines, not a bar redrawn with carriage returns.
    assert "\r" not in run.stdout
    assert "[rank0]: epoch 1/2: 1/23 (4%)" in run.stdout, run.stdout[-3000:]

    files = sorted(trace.glob("rank*.json"))
    assert [f.name.split("-")[0] for f in files] == ["rank0", "rank1"]
    for file in files:
        assert isinstance(json.loads(file.read_text()), list)  # closed at exit: strict JSON

    merged = tmp_path / "merged.json"
    assert shoal("trace", "merge", str(trace), "-o", str(merged)).returncode == 0
    everything = json.loads(merged.read_text())["traceEvents"]
    assert {e["pid"] for e in everything} == {0, 1}
    reductions = [e for e in everything if e["ph"] == "X" and e["name"] == "all_reduce"]
    assert {e["pid"] for e in reductions} == {0, 1}
    assert all(e["args"]["bytes"] > 0 and e["args"]["algorithm"] for e in reductions)
    compute = {(e["pid"], e["name"]) for e in everything if e["ph"] == "X" and e["cat"] == "compute"}
    assert {(0, "forward"), (0, "backward"), (0, "Adam.step"), (1, "backward")} <= compute

    summary = shoal("trace", "summary", str(trace), "--json")
    assert summary.returncode == 0, summary.stderr
    figures = json.loads(summary.stdout)
    assert set(figures["ranks"]) == {"0", "1"} and figures["slowest"] in (0, 1)
    for rank in figures["ranks"].values():
        shares = [rank[k] for k in ("compute_only", "comm_only", "overlap", "idle")]
        assert all(s >= -1e-9 for s in shares) and sum(shares) == pytest.approx(1.0)
        assert rank["compute_s"] > 0 and rank["comm_s"] > 0

    picture = tmp_path / "timeline.png"
    drawn = shoal("trace", "plot", str(trace), "-o", str(picture))
    assert drawn.returncode == 0, drawn.stderr
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = {rank: [line for line in lines if line["rank"] == rank] for rank in (0, 1)}
    assert len(steps[0]) == len(steps[1]) == 46  # 719 and 718 samples per worker, batches of 32, 2 epochs
    for line in steps[0]:
        assert line["samples"] in (32, 15) and line["loss"] > 0 and line["comm_bytes"] > 0
        assert line["compute_s"] > 0 and line["step_s"] > 0
    assert [line["step"] for line in steps[1]] == list(range(1, 47))


def test_a_traced_pipeline_links_each_send_to_its_receive(tmp_path):
    trace = tmp_path / "trace"
    run = subprocess.run([sys.executable, "-m", "shoal.run", "--trace", str(trace), "--nproc-per-node", "2",
                          str(ROOT / "examples" / "pipeline_digits.py"), "--epochs", "1"],
                         capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    merged = tmp_path / "merged.json"
    assert shoal("trace", "merge", str(trace), "-o", str(merged)).returncode == 0
    everything = json.loads(merged.read_text())["traceEvents"]
    starts = {e["id"]: e for e in everything if e["ph"] == "s"}
    ends = {e["id"]: e for e in everything if e["ph"] == "f"}
    linked = starts.keys() & ends.keys()
    # Activations go 0 -> 1 and gradients 1 -> 0, 4 micro-batches per step, 23 steps (+ a header each).
    assert len(linked) >= 2 * 4 * 23
    assert {(starts[i]["pid"], ends[i]["pid"]) for i in linked} == {(0, 1), (1, 0)}
    for flow in linked:
        assert ends[flow]["ts"] >= starts[flow]["ts"], (starts[flow], ends[flow])
    sends = [e for e in everything if e["ph"] == "X" and e["name"].startswith("send to rank")]
    assert all(e["args"]["bytes"] > 0 for e in sends)
    forwards = {e["args"]["microbatch"] for e in everything if e["ph"] == "X" and e["name"].startswith("forward ")}
    assert forwards == {0, 1, 2, 3}


def test_the_flight_records_name_the_rank_that_is_behind(tmp_path):
    trace = tmp_path / "trace"
    run = subprocess.run([sys.executable, "-m", "shoal.run", "--trace", str(trace), "--nproc-per-node", "2",
                          str(SCRIPTS / "stuck_rank.py")], capture_output=True, text=True, timeout=100,
                         env={**os.environ, "SHOAL_TIMEOUT_S": "4"})
    assert run.returncode != 0
    assert "TimeoutError" in run.stdout, run.stdout[-3000:]
    # Rank 0 dumped on its timeout; rank 1, stuck in its own code, when the launcher asked (SIGUSR1).
    assert {p.name.split("-")[1] for p in trace.glob("flight-*.json")} == {"rank0", "rank1"}
    verdict = shoal("trace", "hang", str(trace))
    assert verdict.returncode == 0, verdict.stderr
    assert "behind: rank 1\n" in verdict.stdout, verdict.stdout
    # Three all-reduces done (after init's one), the fifth (#4) is where rank 0 waits.
    assert "stuck on all_reduce(float32, numel=1000, op=SUM) #4 of group 0: ranks [0] wait in it" in verdict.stdout
    assert "rank 1 never issued it; its last operation in the group: all_reduce(float32, numel=1000, op=SUM) #3 " \
           "(completed)" in verdict.stdout


def test_a_receive_whose_send_never_came_names_the_sender():
    def entry(name: str, peer: int, seq: int, state: str) -> dict:
        return {"group": 0, "ranks": [0, 1], "seq": seq, "name": name, "what": "send/recv(float32, numel=4)",
                "nbytes": 16, "peer": peer, "tag": 7, "state": state, "issued": 1.0, "started": 1.0, "ended": None,
                "error": None}

    waiting = [entry("recv", 1, 0, "completed"), entry("recv", 1, 1, "started")]
    records = {0: {"rank": 0, "time": 5.0, "entries": waiting},
               1: {"rank": 1, "time": 5.0, "entries": [entry("send", 0, 0, "completed")]}}
    [finding] = diagnose(records)
    assert finding.waiting == [0] and finding.behind == [1]
    assert finding.op == "recv #1 from rank 1 (tag 7, group 0)"
    assert finding.detail == "rank 0 waits in it; rank 1 has not sent it"


def test_an_operation_that_failed_alike_everywhere_and_was_got_past_is_not_the_hang():
    def entry(seq: int, state: str) -> dict:
        return {"group": 0, "ranks": [0, 1, 2], "seq": seq, "name": "all_reduce", "what": "all_reduce(float32)",
                "nbytes": 16, "peer": None, "tag": None, "state": state, "issued": 1.0, "started": 1.0, "ended": None,
                "error": None}

    # Every rank failed #5 (a mismatch: the group goes on); ranks 0 and 1 wait in #10, which rank 2 never issued.
    ran = [entry(seq, "failed" if seq == 5 else "completed") for seq in range(10)]
    records = {0: {"rank": 0, "time": 5.0, "entries": [*ran, entry(10, "started")]},
               1: {"rank": 1, "time": 5.0, "entries": [*ran, entry(10, "issued")]},
               2: {"rank": 2, "time": 5.0, "entries": ran}}
    [finding] = diagnose(records)
    assert finding.op == "all_reduce(float32) #10 of group 0"
    assert finding.waiting == [0, 1] and finding.behind == [2]


def test_shares_of_a_rank_add_up_and_count_overlap_once():
    spans = [{"cat": "compute", "ts": 0.0, "dur": 60.0}, {"cat": "compute", "ts": 50.0, "dur": 20.0},
             {"cat": "comm", "ts": 40.0, "dur": 40.0}, {"cat": "compute", "ts": 90.0, "dur": 10.0}]
    assert union([(50, 70), (0, 60), (90, 100)]) == [(0, 70), (90, 100)]
    assert intersection([(0, 70), (90, 100)], [(40, 80)]) == [(40, 70)]
    s = rank_summary(spans)
    assert s["compute_only"] == pytest.approx(0.5) and s["overlap"] == pytest.approx(0.3)
    assert s["comm_only"] == pytest.approx(0.1) and s["idle"] == pytest.approx(0.1)  # 80..90
    assert s["hidden"] == pytest.approx(0.75)


def test_a_fault_reaches_the_file_at_once_and_a_timeline_cut_short_by_a_crash_still_reads(tmp_path):
    timeline = Timeline(tmp_path, rank=3, write_every_s=None)  # written only when asked, or for a fault
    events.attach(timeline)
    try:
        with events.span("forward", events.COMPUTE):
            pass
        assert not timeline.path.exists()  # queued
        events.instant("rank 1 lost", events.FAULT, peer=1)
    finally:
        events.detach(timeline)
    text = timeline.path.read_text()
    timeline.path.write_text(text + ',\n{"ph": "X", "name": "half wri')  # what a SIGKILL can leave
    found = read_events(timeline.path)
    assert [e["name"] for e in found if e["ph"] != "M"] == ["forward", "rank 1 lost"]
    assert all(e["pid"] == 3 for e in found)
    timeline.close()


def test_nothing_is_recorded_while_no_sink_is_attached():
    assert not events.active()
    assert events.begin() is None
    with events.span("forward", events.COMPUTE) as args:
        assert args == {}


def test_progress_prints_plain_lines_into_a_log_and_a_bar_into_a_terminal(monkeypatch):
    log = io.StringIO()
    monkeypatch.delenv("SHOAL_TTY", raising=False)
    assert list(progress(range(3), "epoch 1/1", file=log, every_s=0)) == [0, 1, 2]
    lines = log.getvalue().split("\n")
    assert lines[-1] == "" and "\r" not in log.getvalue()
    for n, line in enumerate(lines[:-1], 1):
        assert line.startswith(f"epoch 1/1: {n}/3 ({n / 3:.0%}), ") and line.endswith(" it/s"), line
    monkeypatch.setenv("SHOAL_TTY", "1")  # the launcher's own output is a terminal
    bar = io.StringIO()
    list(progress(range(3), "epoch 1/1", file=bar))
    assert "\r" in bar.getvalue()
