"""Workers that join a running RPC group: three workers start it (w0 serves the store); two more
start without a world size and join it while it runs, at the same time. Every worker then finds
the joiners by name and rank and calls them, the joiners call the first workers and each other,
a name already taken is refused, and the joiners leave before the others, who see them go."""

from __future__ import annotations

import threading

import pytest
import torch

from shoal import rpc
from tests.ranks import run_ranks
from tests.waiting import wait_until

STARTERS, JOINERS = ["w0", "w1", "w2"], ["late1", "late2"]
_done_with_me = threading.Semaphore(0)  # on a joiner: one release per worker done calling it


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _done() -> None:
    _done_with_me.release()


def _name_here() -> str:
    return rpc.get_worker_info().name



def _known(name: str) -> bool:
    try:
        rpc.get_worker_info(name)
    except ValueError:
        return False
    return True


def _worker(rank: int, world: int, port: int) -> dict:
    options = rpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=30)
    if rank < len(STARTERS):
        rpc.init_rpc(STARTERS[rank], rank=rank, world_size=len(STARTERS), rpc_backend_options=options)
    else:
        if rank == len(STARTERS):  # a name the group has: refused, and the group goes on
            with pytest.raises(ValueError, match="name 'w1' is taken"):
                rpc.init_rpc("w1", rpc_backend_options=options)
        rpc.init_rpc(JOINERS[rank - len(STARTERS)], rpc_backend_options=options)  # no rank, no world size
    here = rpc.get_worker_info()
    for joiner in JOINERS:
        wait_until(lambda joiner=joiner: _known(joiner), f"{joiner} has joined", timeout=30)
    seen = {name: rpc.get_worker_info(name).id for name in STARTERS + JOINERS}
    assert rpc.get_worker_info(seen["late1"]).name == "late1"  # by rank too
    doubled = {joiner: rpc.rpc_sync(joiner, _double, args=(torch.tensor([here.id]),)).item() for joiner in JOINERS
               if joiner != here.name}
    remote = rpc.remote(JOINERS[0], _name_here).to_here() if here.name != JOINERS[0] else None
    answered = {name: rpc.rpc_sync(name, _name_here) for name in STARTERS}
    for joiner in JOINERS:
        if joiner != here.name:
            rpc.rpc_sync(joiner, _done)
    lost = []
    if here.name in JOINERS:
        others = len(STARTERS) + len(JOINERS) - 1
        for _ in range(others):  # every other worker is done with it: leave (shutdown does not wait for them)
            assert _done_with_me.acquire(timeout=30)
    else:
        wait_until(lambda: len(rpc.lost_workers()) == len(JOINERS), "the joiners have left", timeout=30)
        lost = sorted(worker.name for worker in rpc.lost_workers())
    rpc.shutdown()
    return {"rank": here.id, "seen": seen, "doubled": doubled, "remote": remote, "answered": answered, "lost": lost}


def test_workers_join_a_running_group_take_calls_and_leave() -> None:
    results = run_ranks(_worker, len(STARTERS) + len(JOINERS), backend=None, timeout=120)
    for rank, out in results.items():
        assert out["seen"]["w0"] == 0 and out["seen"]["w2"] == 2
        assert sorted(out["seen"][joiner] for joiner in JOINERS) == [3, 4], out["seen"]  # the refused one took none
        assert all(value == 2 * out["rank"] for value in out["doubled"].values())
        assert out["remote"] in (None, "late1") and out["answered"] == {name: name for name in STARTERS}
        if rank < len(STARTERS):
            assert out["lost"] == JOINERS  # they left: the others see them go, and shut down without them


def _dynamic_worker(rank: int, world: int, port: int) -> list[str]:
    """torch's dynamic groups: every worker gives its rank and no world size; rank 0 starts alone."""
    options = rpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=30)
    rpc.init_rpc(f"d{rank}", rank=rank, rpc_backend_options=options)
    for other in range(world):
        wait_until(lambda other=other: _known(f"d{other}"), f"d{other} has joined", timeout=30)
    names = [rpc.rpc_sync(f"d{other}", _name_here) for other in range(world)]
    for other in range(world):
        if other != rank:
            rpc.rpc_sync(f"d{other}", _done)
    for _ in range(world - 1):  # a joiner leaves alone: each waits until the others are done with it
        assert _done_with_me.acquire(timeout=30)
    rpc.shutdown()
    return names


def test_a_group_started_by_rank_0_alone_is_joined_at_given_ranks() -> None:
    results = run_ranks(_dynamic_worker, 3, backend=None, timeout=90)
    assert all(names == ["d0", "d1", "d2"] for names in results.values()), results
