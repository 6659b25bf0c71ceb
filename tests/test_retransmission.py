"""Links that drop while both processes live heal themselves: every operation in flight completes with
the right result, an RPC runs once however often its link drops, and a peer that stops answering (a
stopped process) is named by its missing heartbeats instead of hanging until the op timeout."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch

import shoal
import shoal.distributed as dist
from shoal import rpc
from tests.ranks import run_ranks, run_rpc_ranks


class _Chaos:
    """Drops one of this rank's connections at random moments, until stopped."""

    def __init__(self, transport, peers: list[int], seed: int, pause: tuple[float, float]) -> None:
        self.severed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(transport, peers, random.Random(seed), pause))
        self._thread.start()

    def _run(self, transport, peers: list[int], rng: random.Random, pause: tuple[float, float]) -> None:
        while not self._stop.wait(rng.uniform(*pause)):
            transport.sever(rng.choice(peers))
            self.severed += 1

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.severed


def _collectives_under_resets(rank: int, world: int) -> dict:
    peers = [r for r in range(world) if r != rank]
    chaos = _Chaos(dist.default_group().transport, peers, seed=rank, pause=(0.005, 0.05))
    checked = 0
    try:
        for i in range(12):
            for numel in (5, 40_000, 3_000_001):  # direct exchange, ring with one chunk, ring with many
                t = torch.arange(numel, dtype=torch.float32) % 97 + rank * 1000 + i
                dist.all_reduce(t)
                expected = (torch.arange(numel, dtype=torch.float32) % 97) * world + sum(
                    r * 1000 + i for r in range(world))
                assert torch.equal(t, expected), f"all_reduce {numel} wrong in round {i}"
                checked += 1
            blocks = [torch.full((1000 + 7 * d,), float(rank * 10 + d)) for d in range(world)]
            outs = [torch.empty(1000 + 7 * rank) for _ in range(world)]
            dist.all_to_all(outs, blocks)
            assert all(torch.equal(o, torch.full_like(o, float(s * 10 + rank))) for s, o in enumerate(outs))
            big = torch.arange(2_000_000, dtype=torch.float64) + i if rank == 0 else torch.empty(2_000_000,
                                                                                               dtype=torch.float64)
            dist.broadcast(big, 0)
            assert torch.equal(big, torch.arange(2_000_000, dtype=torch.float64) + i)
            right, left = (rank + 1) % world, (rank - 1) % world
            got = torch.empty(300_000)
            work = dist.irecv(got, left)
            dist.send(torch.full((300_000,), float(rank + i)), right)
            work.wait()
            assert torch.equal(got, torch.full((300_000,), float(left + i)))
            checked += 3
    finally:
        severed = chaos.stop()
    dist.barrier()
    return {"checked": checked, "severed": severed}


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_survive_random_connection_resets(world: int) -> None:
    out = run_ranks(_collectives_under_resets, world, timeout=180)
    assert all(o["checked"] == 12 * 6 for o in out.values()), out
    assert sum(o["severed"] for o in out.values()) >= 20, out  # the drops really happened


def _train(steps: int, rank: int) -> list[torch.Tensor]:
    from shoal.parallel import DistributedDataParallel

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512),
                              torch.nn.ReLU(), torch.nn.Linear(512, 10))
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.5)  # several buckets, all-reduced during backward
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(32, 256, generator=data), torch.randint(0, 10, (32,), generator=data)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


def _ddp_under_resets(rank: int, world: int) -> dict:
    calm = _train(15, rank)
    peers = [r for r in range(world) if r != rank]
    chaos = _Chaos(dist.default_group().transport, peers, seed=rank, pause=(0.005, 0.03))
    equal, severed = [], torch.zeros(1)
    try:
        # The same training again until the group's links have dropped 20 times in all (at most 10
        # runs): how many drops one run meets depends on how fast it trains.
        for _ in range(10):
            stormy = _train(15, rank)
            equal.append(all(torch.equal(a, b) for a, b in zip(calm, stormy, strict=True)))
            severed = torch.tensor([float(chaos.severed)])
            dist.all_reduce(severed)
            if severed.item() >= 20:
                break
    finally:
        chaos.stop()
    dist.barrier()
    return {"equal": equal, "severed": int(severed.item())}


def test_ddp_training_under_resets_equals_a_fault_free_run_bit_for_bit() -> None:
    out = run_ranks(_ddp_under_resets, 4, timeout=100)
    for rank, o in out.items():
        assert False not in o["equal"], f"rank {rank}: run {o['equal'].index(False)} differs from the calm one"
    assert out[0]["severed"] >= 20, out  # the drops really happened


_calls = 0


def _count() -> int:
    global _calls
    _calls += 1
    return _calls


def _calls_so_far() -> int:
    return _calls


def _rpc_under_resets(rank: int, world: int) -> dict:
    result = {}
    if rank == 0:
        chaos = _Chaos(rpc.api.current_agent().transport, [1], seed=7, pause=(0.002, 0.02))
        answers: list[int] = []
        # Rounds until the link has dropped often enough (at most 30): how many drops a fixed number
        # of calls meets depends on how fast they run.
        for _ in range(30):
            if len(answers) >= 600 and chaos.severed >= 10:
                break
            answers += [rpc.rpc_sync("worker1", _count) for _ in range(100)]
            futures = [rpc.rpc_async("worker1", _count) for _ in range(100)]
            answers += [f.wait() for f in futures]
        result = {"severed": chaos.stop(), "answers": sorted(answers),
                  "calls": rpc.rpc_sync("worker1", _calls_so_far)}
    return result


def test_an_rpc_runs_exactly_once_however_often_its_link_drops() -> None:
    out = run_rpc_ranks(_rpc_under_resets, 2, names=["worker0", "worker1"], options={"rpc_timeout": 60.0},
                        timeout=180)[0]
    calls = len(out["answers"])
    assert out["answers"] == list(range(1, calls + 1)) and out["calls"] == calls, out
    assert out["severed"] >= 10, out


def _stopped_peer(rank: int, world: int) -> tuple[str, float]:
    pids = torch.zeros(world, dtype=torch.int64)
    pids[rank] = os.getpid()
    dist.all_reduce(pids)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # alive at the TCP level, silent above it
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(10))
        return "no error", 0.0
    except shoal.PeerFailure as exc:
        os.kill(int(pids[1]), signal.SIGKILL)
        return str(exc), time.monotonic() - started


def test_a_stopped_peer_is_named_by_its_missing_heartbeats() -> None:
    # The op timeout (120 s) is far beyond the test's: only the heartbeat can explain a failure in time.
    out = run_ranks(_stopped_peer, 2, timeout=90, group_timeout=120, env={"SHOAL_HEARTBEAT_TIMEOUT": "2"},
                    expect={1: "dies"})
    message, seconds = out[0]
    assert "rank 1" in message and "heartbeat" in message, message
    assert seconds < 30, seconds


def _killed_peer(rank: int, world: int) -> str:
    dist.all_reduce(torch.ones(10))
    if rank == 1:
        os._exit(1)  # the connection drops and nothing listens any more: not a link to heal
    try:
        dist.all_reduce(torch.ones(10))
        return "no error"
    except shoal.PeerFailure as exc:
        return str(exc)


def test_a_dead_peer_is_not_mistaken_for_a_dropped_link() -> None:
    # Rank 0 is the listening side: it must find out by itself that nobody will dial back.
    out = run_ranks(_killed_peer, 2, timeout=60, group_timeout=120, env={"SHOAL_HEAL_TIMEOUT": "100"},
                    expect={1: "dies"})
    assert "rank 1" in out[0] and "process is gone" in out[0], out
