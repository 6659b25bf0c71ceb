"""fully_shard (ZeRO stage 3) trains a small GPT, block by block, to the parameters the unsharded model reaches on
one process with the whole batch, at world sizes 2, 3 and 4 (rows that do not divide evenly, ranks with no rows of
a small parameter), with reshard_after_forward off, with gradients accumulated over two backwards and activation
checkpointing, with frozen and unused parameters, and after a backward that raised halfway; each rank holds its 1/N
of the parameters, gradients and Adam state, and the whole parameters of at most the root and two blocks at once;
the whole state dict it gives loads onto another number of ranks and trains on as the unsharded model does; under
Join, ranks with fewer batches take their part in the others' steps and every rank ends with the model the
unsharded one reaches; a sharded checkpoint of 4 ranks resumes on 3 with its optimizer state. Errors name what to
do."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.ranks import run_ranks
from tests.small_gpt import SmallGPT

VOCAB, DIM, BLOCKS, HEADS, BATCH, LENGTH, STEPS = 30, 5, 3, 1, 12, 8, 3  # 5 rows at 4 ranks: 2, 2, 1, 0


def _gpt() -> SmallGPT:
    torch.manual_seed(0)
    return SmallGPT(VOCAB, DIM, BLOCKS, HEADS).double()


def _batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch, or `rank`'s rows of it."""
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(step))
    rows = tokens.chunk(world)[rank]
    return rows[:, :-1], rows[:, 1:].flatten()


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, rank: int = 0, world: int = 1,
           accumulate: int = 1) -> None:
    """Each step: `accumulate` backwards of the batch's halves (the mean of their losses), then a step."""
    for step in steps:
        x, y = _batch(step, rank, world)
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate), strict=True):
            (nn.functional.cross_entropy(model(xs), ys) / accumulate).backward()
        optimizer.step()
        optimizer.zero_grad()


def _reference(steps: int = STEPS) -> dict[str, torch.Tensor]:
    model = _gpt()
    _train(model, torch.optim.Adam(model.parameters(), lr=0.01), range(steps))
    return model.state_dict()


def _sharded_gpt(reshard_after_forward: bool = True) -> SmallGPT:
    from shoal.parallel import fully_shard

    model = _gpt()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    return fully_shard(model)


def _gathered(model: nn.Module) -> list[str]:
    """The fully_shard modules whose whole parameters hold memory now, or are being gathered."""
    from shoal.parallel import FSDPModule

    def holds(group) -> bool:
        return group._gathering is not None or any(slot.full.untyped_storage().nbytes() for slot in group.params)
    return [name or "root" for name, module in model.named_modules()
            if isinstance(module, FSDPModule) and holds(module._shoal_shards.group)]


def _checkpoint_blocks(model: SmallGPT) -> None:
    """Activation checkpointing: each block's forward runs again in backward, inside the engine."""
    from torch.utils.checkpoint import checkpoint

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        x = model.embed(tokens)
        for block in model.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return model.head(x).flatten(0, 1)
    model.forward = forward


def _sharded_training(rank: int, world: int, reshard_after_forward: bool, accumulate: int,
                      checkpointed: bool) -> dict:
    model = _sharded_gpt(reshard_after_forward)
    if checkpointed:
        _checkpoint_blocks(model)
    held = sum(p.numel() for p in model.parameters())
    at_once: list[list[str]] = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: at_once.append(_gathered(model)))  # runs after fully_shard's
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, optimizer, range(STEPS), rank, world, accumulate)
    state_numel = sum(t.numel() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    state = model.state_dict()
    x, y = _batch(0, rank, world)
    nn.functional.cross_entropy(model(x), y).backward()
    return {"state": state, "held": held, "adam_state": state_numel, "at_once": at_once, "freed": _gathered(model),
            "grad_numel": sum(p.grad.numel() for p in model.parameters())}


@pytest.mark.parametrize(("world", "reshard_after_forward", "accumulate", "checkpointed"),
                         [(2, True, 2, True), (3, False, 1, False), (4, True, 1, False)])
def test_sharded_training_equals_the_unsharded_model(world: int, reshard_after_forward: bool, checkpointed: bool,
                                                     accumulate: int) -> None:
    out = run_ranks(_sharded_training, world, reshard_after_forward, accumulate, checkpointed)
    reference = _reference()
    for rank in range(world):
        for key, value in reference.items():
            torch.testing.assert_close(out[rank]["state"][key], value, rtol=1e-9, atol=1e-9,
                                       msg=lambda m, k=key, r=rank: f"rank {r}, {k}: {m}")
    whole = sum(p.numel() for p in _gpt().parameters())
    rows_padded = sum(math.ceil(p.shape[0] / world) * p[0].numel() for p in _gpt().parameters())
    held = [out[rank]["held"] for rank in range(world)]
    assert sum(held) == whole, f"the shards of {world} ranks hold {held} elements, the model {whole}"
    assert max(held) <= rows_padded, f"a rank holds {max(held)} elements, its padded share is {rows_padded}"
    for rank in range(world):
        assert out[rank]["adam_state"] == 2 * held[rank], "Adam's state is two tensors the size of the shards"
        assert out[rank]["grad_numel"] == held[rank], "each rank's gradients are its shards' size"
        assert out[rank]["freed"] == [], f"whole parameters outlive backward: {out[rank]['freed']}"
        most = max(len(gathered) for gathered in out[rank]["at_once"])
        limit = 1 + BLOCKS if not reshard_after_forward else 3  # the root, this block, the next one prefetched
        assert most <= limit, f"whole parameters of {most} modules at once: {out[rank]['at_once']}"


class _Branches(nn.Module):
    """A block with a frozen layer and a layer its forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.frozen, self.unused = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(torch.tanh(self.used(x)))


def _branches() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(_Branches(), _Branches(), nn.Linear(5, 2)).double()


def _train_branches(model: nn.Module, rank: int, world: int) -> None:
    """Three steps, the second after a backward that raises halfway (its gradients dropped)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        if step == 1:
            _failed_backward(model, rank, world)
            optimizer.zero_grad()
        target = torch.ones(8 // world, 2, dtype=torch.float64)
        nn.functional.mse_loss(model(_rows(step, rank, world)), target).backward()
        optimizer.step()
        optimizer.zero_grad()


def _rows(step: int, rank: int, world: int) -> torch.Tensor:
    return torch.randn(8, 5, generator=torch.Generator().manual_seed(step), dtype=torch.float64).chunk(world)[rank]


def _failed_backward(model: nn.Module, rank: int, world: int) -> None:
    def fail(grad: torch.Tensor) -> None:
        raise RuntimeError("a backward that fails halfway")

    def fail_in_backward(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        output.register_hook(fail)
    hook = model[1].register_forward_hook(fail_in_backward)
    try:
        model(_rows(9, rank, world)).sum().backward()
    except RuntimeError as exc:
        assert "fails halfway" in str(exc), exc
    hook.remove()


def _edges(rank: int, world: int) -> dict:
    from shoal.parallel import Join, fully_shard

    model = _branches()
    for block in model[:2]:
        fully_shard(block)
    fully_shard(model)
    _train_branches(model, rank, world)
    errors = {}
    for label, call in {
        "again": lambda: fully_shard(model),
        "mesh": lambda: fully_shard(nn.Linear(2, 2), mesh=object()),
        "scalar": lambda: fully_shard(nn.ParameterList([nn.Parameter(torch.tensor(1.0))])),
        "dtypes": lambda: fully_shard(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())),
        "shared": lambda: fully_shard(_tied()),
        "shared across calls": lambda: _shard_each(_tied()),
        "ignored in one call only": lambda: _shard_each(_tied(), ignore_first=True),
        "join without optimizer": lambda: Join([model]),
        "join on a block": lambda: Join([model[0]], optimizer=torch.optim.SGD(model.parameters(), lr=0.1)),
        "join on a block before any forward": lambda: _join_on_a_block(rank, world),
    }.items():
        try:
            call()
        except (TypeError, ValueError) as exc:
            errors[label] = f"{type(exc).__name__}: {exc}"
    return {"state": model.state_dict(), "errors": errors}


def _shard_each(model: nn.Sequential, ignore_first: bool = False) -> None:
    from shoal.parallel import fully_shard

    for i, layer in enumerate(model):
        fully_shard(layer, ignored_params=[layer.weight] if ignore_first and i == 0 else None)


def _join_on_a_block(rank: int, world: int) -> None:
    from shoal.parallel import Join, fully_shard

    model = _branches()
    for block in model[:2]:
        fully_shard(block)
    fully_shard(model)
    with Join([model[0]], optimizer=torch.optim.SGD(model.parameters(), lr=0.1)):
        model(_rows(0, rank, world))


def _tied() -> nn.Sequential:
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    second.weight = first.weight
    return nn.Sequential(first, second)


def test_frozen_and_unused_parameters_and_a_failed_backward_train_as_unsharded_and_mistakes_are_named() -> None:
    out = run_ranks(_edges, 2)
    reference = _branches()
    _train_branches(reference, 0, 1)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(out[0]["state"][key], value, rtol=1e-9, atol=1e-9, msg=lambda m, k=key: f"{k}: {m}")
    errors = out[0]["errors"]
    assert errors["again"].startswith("ValueError: fully_shard was already called"), errors
    assert "pass group=" in errors["mesh"], errors
    assert "0-dimensional parameter '0'" in errors["scalar"], errors
    assert "one dtype" in errors["dtypes"] and "torch.float64" in errors["dtypes"], errors
    assert "'1.weight' is the same parameter as '0.weight'" in errors["shared"], errors
    assert "'weight' is the same parameter as 'a parameter another fully_shard call sharded'" in errors[
        "shared across calls"], errors
    assert "'weight' was left whole by an earlier call" in errors["ignored in one call only"], errors
    assert "Join([model], optimizer=opt)" in errors["join without optimizer"], errors
    assert "takes the root fully_shard module" in errors["join on a block"], errors
    assert "takes the root fully_shard module" in errors["join on a block before any forward"], errors


def _resume(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    model = _sharded_gpt()
    model.load_state_dict(torch.load(path))
    _train(model, torch.optim.SGD(model.parameters(), lr=0.05), range(STEPS, STEPS + 2), rank, world)
    return model.state_dict()


def test_a_whole_state_dict_loads_onto_any_number_of_ranks(tmp_path) -> None:
    """What `state_dict()` gives on 4 ranks is the reference's (the test above); loaded on 3 ranks, each takes
    its rows, and training goes on as the unsharded model's."""
    path = str(tmp_path / "gpt.pt")
    saved = _reference()
    torch.save(saved, path)
    resumed = run_ranks(_resume, 3, path)
    reference = _gpt()
    reference.load_state_dict(saved)
    _train(reference, torch.optim.SGD(reference.parameters(), lr=0.05), range(STEPS, STEPS + 2))
    for rank in range(3):
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(resumed[rank][key], value, rtol=1e-9, atol=1e-9,
                                       msg=lambda m, k=key, r=rank: f"rank {r}, {k}: {m}")


UNEVEN = [1, 3, 2]  # batches per rank


def _uneven(rank: int, world: int) -> dict[str, torch.Tensor]:
    from shoal.parallel import Join

    model = _sharded_gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with Join([model], optimizer=optimizer):
        _train(model, optimizer, range(UNEVEN[rank]), rank, world)
    return model.state_dict()


def test_ranks_with_fewer_batches_join_and_every_rank_ends_with_the_same_model() -> None:
    """A joined rank gives zeros to the mean, as under DDP's Join: step s trains on the rows of the ranks that
    still have batch s, its loss divided by the number of ranks."""
    world = len(UNEVEN)
    out = run_ranks(_uneven, world)
    reference = _gpt()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(max(UNEVEN)):
        live = [rank for rank in range(world) if step < UNEVEN[rank]]
        loss = sum(nn.functional.cross_entropy(reference(x), y) for x, y in (_batch(step, r, world) for r in live))
        (loss / world).backward()
        optimizer.step()
        optimizer.zero_grad()
    for rank in range(world):
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(out[rank][key], value, rtol=1e-9, atol=1e-9,
                                       msg=lambda m, k=key, r=rank: f"rank {r}, {k}: {m}")


SAVED = 2  # steps, each saved


def _save_shards(rank: int, world: int, directory: str) -> None:
    from shoal.checkpoint import ShardedCheckpoint

    model = _sharded_gpt()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    checkpoints = ShardedCheckpoint(directory)
    for step in range(SAVED):
        _train(model, optimizer, range(step, step + 1), rank, world)
        checkpoints.save(step + 1, model, optimizer, extra={"steps": step + 1})


def _resume_shards(rank: int, world: int, directory: str) -> dict:
    from shoal.checkpoint import ShardedCheckpoint

    model = _sharded_gpt()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    latest = ShardedCheckpoint(directory).load_latest(model, optimizer)
    _train(model, optimizer, range(latest.step, STEPS + 1), rank, world)
    return {"step": latest.step, "extra": latest.state["extra"], "state": model.state_dict()}


def test_a_sharded_checkpoint_of_four_ranks_resumes_on_three_with_its_optimizer_state(tmp_path) -> None:
    """Each rank writes its rows of the parameters and of Adam's moments; 3 ranks take theirs from the 4 files.
    The newest step lacks rank 3's file (a job stopped mid-save), so the one before is loaded."""
    run_ranks(_save_shards, 4, str(tmp_path))
    next(tmp_path.glob(f"step-{SAVED:010d}-rank3.pt")).unlink()
    out = run_ranks(_resume_shards, 3, str(tmp_path))
    reference = _reference(STEPS + 1)
    for rank in range(3):
        assert (out[rank]["step"], out[rank]["extra"]) == (SAVED - 1, {"steps": SAVED - 1}), out[rank]
        for key, value in reference.items():
            torch.testing.assert_close(out[rank]["state"][key], value, rtol=1e-9, atol=1e-9,
                                       msg=lambda m, k=key, r=rank: f"rank {r}, {k}: {m}")
