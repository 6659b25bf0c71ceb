"""Live recovery of fully_shard training: a worker killed at some step, the survivors (the same processes)
re-shard the model over the next generation from the lost worker's buddy, with no checkpoint, and finish the
epoch; every sample is trained once, and the model (parameters and Adam's state, which a lost block's rows
carry) equals a replay of the committed steps in one unsharded process."""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import pytest
import torch
from torch import nn

from shoal.comm.store import Store
from shoal.data import ElasticSampler
from shoal.elastic.live import LiveTraining
from shoal.parallel import fully_shard
from tests.live_reports import replay
from tests.ranks import run_ranks

SAMPLES, BATCH, SEED = 61, 2, 1
QUIET = {"SHOAL_HEARTBEAT_TIMEOUT": "30"}  # as in test_live.py: losses are seen as closed sockets


def _data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(SAMPLES, 6, generator=generator, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def _model() -> nn.Module:
    """Five rows in the first layer: over 3 workers blocks of 2, 2 and 1 rows; over 2, of 3 and 2."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _adam(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.05)


def _train(rank: int, world: int, _: int, store_port: int, kills: dict[int, int], redundancy: int) -> tuple:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port),
                      TORCHELASTIC_USE_AGENT_STORE="True", SHOAL_LIVE="1")  # as `shoal run --live` sets them
    data, model = _data(), _model()
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    optimizer = _adam(model.parameters())
    sampler = ElasticSampler(data, BATCH, rank=rank, world_size=world, seed=SEED)
    live = LiveTraining(model, optimizer, sampler, redundancy=redundancy, timeout=timedelta(seconds=30))
    ledger = []
    for x, y in live.batches(torch.utils.data.DataLoader(data, batch_sampler=sampler)):
        if kills.get(rank) == live.steps:
            os.kill(os.getpid(), signal.SIGKILL)
        start = sampler.offset
        with live.step() as step:
            nn.functional.cross_entropy(live.model(x), y).backward()
        if step.committed:
            ledger.append((start, sampler.offset, live.generation.size))
    whole = {name: value.clone() for name, value in model.state_dict().items()}  # gathered: before close
    mine = [(p.detach().clone(), {k: v.clone() for k, v in optimizer.state[p].items()}) for p in model.parameters()]
    live.close()
    return ledger, whole, mine, live.generation.number


@pytest.mark.parametrize(("kills", "redundancy"), [({}, 1), ({1: 3}, 1), ({0: 6}, 1), ({0: 4, 1: 4}, 2)],
                         ids=["no loss", "rank 1 killed at step 3", "rank 0 killed at step 6",
                              "ranks 0 and 1 killed together at step 4, redundancy 2"])
def test_survivors_reshard_from_buddies_and_equal_an_unsharded_replay(kills: dict[int, int], redundancy: int) -> None:
    store = Store.connect("127.0.0.1", 0, world_size=1, is_server=True)  # the launcher's
    world = 3
    out = run_ranks(_train, world, store.raw.port, kills, redundancy, backend=None, timeout=90,
                    expect={victim: "dies" for victim in kills}, env=QUIET)
    survivors = [r for r in range(world) if r not in kills]
    ledger, whole, _, generation = out[survivors[0]]
    for rank in survivors[1:]:
        assert out[rank][0] == ledger and out[rank][3] == generation
        assert all(torch.equal(whole[k], out[rank][1][k]) for k in whole)
    assert generation == (1 if kills else 0)
    assert [start for start, _, _ in ledger] == [0] + [stop for _, stop, _ in ledger[:-1]]  # no gap, no overlap
    assert ledger[-1][1] == SAMPLES
    reference = _model()
    optimizer = _adam(reference.parameters())
    want = replay(ledger, _data(), reference, optimizer, SEED)
    for (name, got), expected in zip(whole.items(), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12, msg=name)
    # Adam's moments: each survivor's rows of them are the replay's rows in the last layout
    for rank, survivor in enumerate(survivors):
        for (shard, state), param in zip(out[survivor][2], reference.parameters(), strict=True):
            rows = -(-param.shape[0] // len(survivors))
            block = slice(min(rank * rows, param.shape[0]), min((rank + 1) * rows, param.shape[0]))
            torch.testing.assert_close(shard, param.detach()[block], rtol=1e-10, atol=1e-12)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(state[key], optimizer.state[param][key][block], rtol=1e-10, atol=1e-12)
            assert state["step"] == optimizer.state[param]["step"]
