"""Live recovery of fully_shard training: a worker killed at some step, the survivors (the same processes)
re-shard the model over the next generation from the lost worker's buddy, with no checkpoint, and finish the
epoch; every sample is trained once, and the model (parameters and Adam's state, which a lost block's rows
carry) equals a replay of the committed steps in one unsharded process. A worker killed in the middle of a
backward leaves the others with gathers and reductions in flight on the broken group."""

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
from shoal.elastic.shard_keeper import ShardKeeper
from shoal.parallel import fully_shard
from tests.live_reports import live_data, replay
from tests.ranks import RankFailed, run_ranks

SAMPLES, BATCH, SEED = 61, 2, 1
QUIET = {"SHOAL_HEARTBEAT_TIMEOUT": "30"}  # as in test_live.py: losses are seen as closed sockets


def _model() -> nn.Module:
    """Five rows in the first layer: over 3 workers blocks of 2, 2 and 1 rows; over 2, of 3 and 2."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _adam(params: object) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW, whose constructor does not take all its `defaults`, and a schedule, which wraps its `step`."""
    optimizer = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)


def _train(rank: int, world: int, _: int, store_port: int, kills: dict[int, int], in_backward: bool,
           redundancy: int) -> tuple:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port),
                      TORCHELASTIC_USE_AGENT_STORE="True", SHOAL_LIVE="1")  # as `shoal run --live` sets them
    data, model = live_data(SAMPLES), _model()
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    optimizer, scheduler = _adam(model.parameters())
    sampler = ElasticSampler(data, BATCH, rank=rank, world_size=world, seed=SEED)
    live = LiveTraining(model, optimizer, sampler, extra={"scheduler": scheduler}, redundancy=redundancy,
                        timeout=timedelta(seconds=30))

    def die_here(*_: object) -> None:
        if kills.get(rank) == live.steps:
            os.kill(os.getpid(), signal.SIGKILL)

    if in_backward:  # between the last layer's backward (its reduce-scatter) and the first's (its gather)
        model[1].register_full_backward_hook(die_here)
    ledger = []
    for x, y in live.batches(torch.utils.data.DataLoader(data, batch_sampler=sampler)):
        if not in_backward:
            die_here()
        start = sampler.offset
        with live.step() as step:
            nn.functional.cross_entropy(live.model(x), y).backward()
        if step.committed:
            scheduler.step()
            ledger.append((start, sampler.offset, live.generation.size))
    whole = {name: value.clone() for name, value in model.state_dict().items()}  # gathered: before close
    mine = [(p.detach().clone(), {k: v.clone() for k, v in optimizer.state[p].items()}) for p in model.parameters()]
    live.close()
    return ledger, whole, mine, live.generation.number


@pytest.mark.parametrize(("kills", "in_backward", "redundancy"),
                         [({}, False, 1), ({1: 3}, False, 1), ({0: 6}, True, 1), ({0: 4, 1: 4}, False, 2)],
                         ids=["no loss", "rank 1 killed before step 3", "rank 0 killed in step 6's backward",
                              "ranks 0 and 1 killed together before step 4, redundancy 2"])
def test_survivors_reshard_from_buddies_and_equal_an_unsharded_replay(kills: dict[int, int], in_backward: bool,
                                                                     redundancy: int) -> None:
    store = Store.connect("127.0.0.1", 0, world_size=1, is_server=True)  # the launcher's
    world = 3
    out = run_ranks(_train, world, store.raw.port, kills, in_backward, redundancy, backend=None, timeout=90,
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
    optimizer, scheduler = _adam(reference.parameters())
    want = replay(ledger, live_data(SAMPLES), reference, optimizer, SEED, scheduler)
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


def _keep_bound_model(rank: int, world: int) -> str:
    model = _model()
    fully_shard(model)  # over the default group: cut already, not LiveTraining's to cut
    with pytest.raises(ValueError, match="call fully_shard with no group") as refused:
        ShardKeeper(model, _adam(model.parameters())[0], redundancy=1)
    return str(refused.value)


def test_a_model_sharded_over_a_group_of_its_own_is_refused() -> None:
    assert len(set(run_ranks(_keep_bound_model, 2).values())) == 1


def _train_with_adafactor(rank: int, world: int, _: int, store_port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port),
                      TORCHELASTIC_USE_AGENT_STORE="True", SHOAL_LIVE="1")
    data, model = live_data(SAMPLES), _model()
    fully_shard(model)
    optimizer = torch.optim.Adafactor(model.parameters())  # its moments of a matrix: one per row, one per column
    sampler = ElasticSampler(data, BATCH, rank=rank, world_size=world, seed=SEED)
    live = LiveTraining(model, optimizer, sampler, timeout=timedelta(seconds=30))
    x, y = data[:2]
    with live.step():
        nn.functional.cross_entropy(live.model(x), y).backward()


def test_optimizer_state_that_cannot_be_cut_with_the_rows_is_refused_at_the_first_step() -> None:
    store = Store.connect("127.0.0.1", 0, world_size=1, is_server=True)
    with pytest.raises(RankFailed, match="neither one row per row of the shard"):
        run_ranks(_train_with_adafactor, 2, store.raw.port, backend=None, timeout=60)
