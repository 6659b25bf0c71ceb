"""Join on uneven inputs: under `with ddp.join():` ranks with fewer batches finish, and every rank ends with
the model torch's DDP under torch's Join ends with on gloo, for both ways of dividing gradients, one Join
object over two epochs, forwards under no_grad() and accumulation under no_sync() inside the block, the fp16
compress hook and gradient_as_bucket_view; after the block, one rank evaluates alone (no collective, unlike
torch); throw_on_early_termination raises what torch raises, where torch raises it; a Joinable of one's own
sees its hooks called as torch's Join calls them; bad arguments are refused."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from tests.ranks import run_ranks

BATCH = 4
KINDS = ("batchnorm", "branchy")  # buffers broadcast from a live rank; find_unused_parameters' flags shadowed
# (model kind, divide_by_initial_world_size, variant): every run compares the models shoal and torch end with.
CASES = [*((kind, divide, "plain") for kind in KINDS for divide in (True, False)),
         ("batchnorm", True, "two epochs"),  # one Join object, entered once per epoch, the skew reversed in the second
         ("batchnorm", False, "no_grad"),  # each step also a forward under no_grad(): nothing for joined ranks to do
         ("branchy", False, "no_sync"),  # every other step accumulates under no_sync(), then one step averages the sum
         ("branchy", False, "fp16"),  # a hook of its own divides (by the group's size): the live count does not apply
         ("batchnorm", False, "bucket view")]  # gradient_as_bucket_view=True: .grad views the buckets
FP16_TOLERANCE = 1e-3  # float16 sums of three ranks may add in another order on each side


class _Branchy(nn.Module):
    """A model with a head that forward never uses: it needs find_unused_parameters=True."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.unused = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "batchnorm":  # train mode: running statistics differ per rank until a broadcast
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double()
    return _Branchy().double()


def _batches(rank: int) -> int:
    return 3 + rank  # uneven: the highest rank trains longest


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=gen)


class _Impl(NamedTuple):
    """One side of the comparison: its DDP class and fp16 compress hook, and whether a forward under
    no_grad() may go through its DDP inside join(). torch's may not: it announces a synchronizing step, the
    joined ranks shadow a backward that never comes, and gloo aborts on the mismatched collectives. Its
    runs make that forward with the module itself, which is what shoal's DDP makes of it (no collective)."""

    ddp: type
    fp16_hook: Callable
    no_grad_through_ddp: bool


def _train(impl: _Impl, rank: int, world: int, case: tuple[str, bool, str]) -> dict[str, torch.Tensor]:
    """Train on this rank's batches under ddp.join(); the state dict after the join (buffers included)."""
    kind, divide, variant = case
    net = _model(kind)
    ddp = impl.ddp(net, find_unused_parameters=kind == "branchy", gradient_as_bucket_view=variant == "bucket view")
    if variant == "fp16":
        ddp.register_comm_hook(None, impl.fp16_hook)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    join = ddp.join(divide_by_initial_world_size=divide)
    epochs = [_batches(rank), _batches(world - 1 - rank)] if variant == "two epochs" else [_batches(rank)]
    for epoch, batches in enumerate(epochs):
        with join:
            for step in range(batches):
                x, y = _batch(rank, 100 * epoch + step)
                if variant == "no_grad":
                    with torch.no_grad():
                        (ddp if impl.no_grad_through_ddp else net)(x)
                accumulate = variant == "no_sync" and step % 2 == 0
                with ddp.no_sync() if accumulate else contextlib.nullcontext():
                    nn.functional.cross_entropy(ddp(x), y).backward()
                if not accumulate:
                    optimizer.step()
                    optimizer.zero_grad()
    return {name: t.detach().clone() for name, t in net.state_dict().items()}


def _early_termination(ddp_class: type, rank: int) -> tuple[int, str, str] | None:
    """Train with throw_on_early_termination=True: (steps done, the error's type and message)."""
    ddp = ddp_class(_model("batchnorm"))
    done = 0
    try:
        with ddp.join(throw_on_early_termination=True):
            for step in range(_batches(rank)):
                x, y = _batch(rank, step)
                nn.functional.cross_entropy(ddp(x), y).backward()
                done += 1
    except RuntimeError as exc:
        return done, type(exc).__name__, str(exc)
    return None


def _counting(join: ModuleType, dist: ModuleType, rank: int) -> dict[str, Any]:
    """Two Joinables of our own under one Join: the first all-reduces a 1 each iteration (its hook shadows
    it with a 0); the second makes no collectives. What each hook saw, and what notify_join_context gave."""

    class Hook(join.JoinHook):
        def __init__(self, owner: Any) -> None:
            self.owner = owner

        def main_hook(self) -> None:
            self.owner.main_calls += 1
            if self.owner.collective:
                shadow = torch.zeros(1)
                dist.all_reduce(shadow)
                self.owner.shadowed.append(shadow.item())

        def post_hook(self, is_last_joiner: bool) -> None:
            self.owner.post.append(is_last_joiner)

    class Counter(join.Joinable):
        def __init__(self, collective: bool) -> None:
            super().__init__()
            self.collective, self.main_calls, self.post, self.shadowed, self.kwargs = collective, 0, [], [], None

        def join_hook(self, **kwargs: Any) -> Any:
            self.kwargs = kwargs
            return Hook(self)

        @property
        def join_device(self) -> torch.device:
            return torch.device("cpu")

        @property
        def join_process_group(self) -> Any:
            return dist.group.WORLD

    counters, notified, sums = [Counter(True), Counter(False)], [], []
    with join.Join(counters, answer=42):
        for _ in range(_batches(rank)):
            notified.append([join.Join.notify_join_context(c) is not None for c in counters])
            live = torch.ones(1)
            dist.all_reduce(live)
            sums.append(live.item())
    off = Counter(False)
    with join.Join([off], enable=False):  # even inputs: nothing is shadowed, no hook runs
        notified_off = join.Join.notify_join_context(off)
        dist.all_reduce(torch.ones(1))
    return {"main_calls": [c.main_calls for c in counters], "post": [c.post for c in counters],
            "kwargs": [c.kwargs for c in counters], "shadowed": counters[0].shadowed, "notified": notified,
            "sums": sums, "disabled": (off.main_calls, off.post, notified_off)}


def _torch_ranks(rank: int, world: int, port: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.algorithms import join
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        impl = _Impl(DistributedDataParallel, fp16_compress_hook, no_grad_through_ddp=False)
        return {"train": {case: _train(impl, rank, world, case) for case in CASES},
                "throw": _early_termination(DistributedDataParallel, rank),
                "counting": _counting(join, dist, rank)}
    finally:
        dist.destroy_process_group()


@functools.cache
def _torch(world: int) -> dict[int, dict[str, Any]]:
    """What torch's DDP and Join do on gloo, once per world size for every test that compares with it."""
    return run_ranks(_torch_ranks, world, backend=None, timeout=180)


def _evaluate_alone_after_join(rank: int, world: int) -> float:
    """Train under ddp.join(), then rank 0 alone runs a forward under no_grad() and every rank all-reduces its
    rank + 1. Outside the block DDP makes no join collective (torch's would announce the step, and wait for
    partners that never come): had rank 0 made one, the all-reduce would pair with it and fail, or hang
    until the test's timeout."""
    import shoal.distributed as dist
    from shoal.parallel import DistributedDataParallel

    net = _model("batchnorm")
    ddp = DistributedDataParallel(net)
    with ddp.join():
        for step in range(_batches(rank)):
            x, y = _batch(rank, step)
            nn.functional.cross_entropy(ddp(x), y).backward()
    if rank == 0:
        with torch.no_grad():
            ddp(_batch(rank, 0)[0])
    total = torch.tensor([rank + 1.0, 0.0, 0.0], dtype=torch.float64)  # not the join's one-element shape
    dist.all_reduce(total)
    return total[0].item()


def _shoal_training(rank: int, world: int) -> dict[str, Any]:
    from shoal.parallel import DistributedDataParallel, fp16_compress_hook

    impl = _Impl(DistributedDataParallel, fp16_compress_hook, no_grad_through_ddp=True)
    trained: dict[Any, Any] = {case: _train(impl, rank, world, case) for case in CASES}
    trained["alone"] = _evaluate_alone_after_join(rank, world)
    try:
        _ = DistributedDataParallel(nn.Tanh()).join_device
    except ValueError as exc:
        trained["no parameters"] = str(exc)
    return trained


@pytest.mark.parametrize(("backend", "world"), [("shoal", 2), ("shoal", 3), ("gloo", 2)])
def test_uneven_inputs_under_join_finish_with_torch_s_model(backend: str, world: int) -> None:
    ours = run_ranks(_shoal_training, world, backend=backend, timeout=180)
    theirs = _torch(world)
    for case, want in theirs[world - 1]["train"].items():
        tolerance = {"atol": FP16_TOLERANCE, "rtol": FP16_TOLERANCE} if case[2] == "fp16" else {}
        for rank in range(world):
            got = ours[rank][case]
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], **tolerance, msg=f"{case}, rank {rank}: {name}")
    for kind in KINDS:  # the two divisions differ, so that the comparison above tells them apart
        by_initial, by_live = theirs[0]["train"][(kind, True, "plain")], theirs[0]["train"][(kind, False, "plain")]
        assert any(not torch.allclose(by_initial[n], by_live[n]) for n in by_initial), kind
    # The fp16 hook divides by the group's size even with divide_by_initial_world_size=False: its model is the
    # default hook's divided by the initial world size, to float16's precision, and far from the one divided
    # by the live ranks; so the comparison above tells a rescaled result apart.
    fp16 = theirs[0]["train"][("branchy", False, "fp16")]
    by_initial, by_live = (theirs[0]["train"][("branchy", divide, "plain")] for divide in (True, False))

    def gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max((a[n] - b[n]).abs().max().item() for n in a)
    assert gap(fp16, by_initial) < FP16_TOLERANCE < gap(fp16, by_live) / 5
    for rank in range(world):
        assert ours[rank]["alone"] == world * (world + 1) / 2
        assert "the wrapped Tanh has no parameters" in ours[rank]["no parameters"], ours[rank]["no parameters"]


def _shoal_termination(rank: int, world: int) -> tuple[int, str, str] | None:
    from shoal.parallel import DistributedDataParallel

    return _early_termination(DistributedDataParallel, rank)


@pytest.mark.parametrize("world", [2, 3])
def test_throw_on_early_termination_raises_on_every_rank_as_torch_does(world: int) -> None:
    ours = run_ranks(_shoal_termination, world, timeout=120)
    theirs = {rank: outcome["throw"] for rank, outcome in _torch(world).items()}
    assert ours == theirs
    assert ours[0] == (3, "RuntimeError", "Rank 0 exhausted all inputs.")  # the first to run out, at its exit
    for rank in range(1, world):  # the others, at their next forward
        assert ours[rank] == (3, "RuntimeError",
                              "Detected at least one rank that exhausted inputs. Throwing across all ranks.")


def _shoal_counting(rank: int, world: int) -> dict[str, Any]:
    import shoal.distributed as dist
    from shoal.parallel import join

    return _counting(join, dist, rank)


@pytest.mark.parametrize("world", [2, 3])
def test_a_joinable_of_one_s_own_sees_its_hooks_called_as_torch_s_join_calls_them(world: int) -> None:
    ours = run_ranks(_shoal_counting, world, timeout=120)
    assert ours == {rank: outcome["counting"] for rank, outcome in _torch(world).items()}
    last = _batches(world - 1)

    def live(step: int) -> float:  # how many ranks still iterate at `step`
        return float(sum(_batches(r) > step for r in range(world)))

    for rank, seen in ours.items():
        joined = last - _batches(rank)  # iterations this rank shadows
        assert seen["main_calls"] == [joined, joined], rank
        assert seen["post"] == [[rank == world - 1]] * 2, rank
        assert seen["kwargs"] == [{"answer": 42}] * 2
        assert seen["notified"] == [[True, False]] * _batches(rank)  # only the first makes the collectives
        assert seen["sums"] == [live(step) for step in range(_batches(rank))]
        assert seen["shadowed"] == [live(step) for step in range(_batches(rank), last)]
        assert seen["disabled"] == (0, [], None)


def _joinables(join: ModuleType) -> tuple[type, type]:
    """A Joinable whose process group is what it is given, and one whose constructor skips Joinable's."""

    class OnGroup(join.Joinable):
        def __init__(self, group: object) -> None:
            super().__init__()
            self.group = group

        def join_hook(self, **kwargs: Any) -> Any:
            return join.JoinHook()

        @property
        def join_device(self) -> torch.device:
            return torch.device("cpu")

        @property
        def join_process_group(self) -> object:
            return self.group

    class SkipsInit(OnGroup):
        def __init__(self) -> None:
            self.group = None

    return OnGroup, SkipsInit


def test_bad_arguments_are_refused_as_torch_refuses_them() -> None:
    import torch.distributed.algorithms.join as torch_join

    from shoal.parallel import join

    for module in (join, torch_join):
        with pytest.raises(ValueError, match=r"^The join context manager requires at least one joinable$"):
            module.Join([])
        on_group, skips_init = _joinables(module)
        with pytest.raises(ValueError, match=r"^Using join context manager with multiple process groups$"):
            module.Join([on_group(object()), on_group(object())])
        with pytest.raises(AssertionError, match=re.escape("constructor calls the ``Joinable`` constructor")):
            module.Join.notify_join_context(skips_init())
        assert module.Join.notify_join_context(on_group(None)) is None  # outside any Join: nothing to do
        with pytest.raises(TypeError):
            module.Joinable()  # abstract
    # torch fails on a non-Joinable with an AttributeError from inside (no join_hook); shoal says what it wants.
    with pytest.raises(TypeError, match=r"joinables\[1\] is a Linear, not a Joinable"):
        join.Join([_joinables(join)[0](None), nn.Linear(2, 2)])


def _signature(fn: Any) -> list[tuple[str, Any, Any]]:
    import inspect

    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_names_parameters_and_defaults_are_torch_s() -> None:
    import torch.distributed.algorithms.join as torch_join
    import torch.nn.parallel as torch_parallel

    from shoal import parallel

    pairs = [(parallel.Join.__init__, torch_join.Join.__init__),
             (parallel.Join.notify_join_context, torch_join.Join.notify_join_context),
             (parallel.JoinHook.main_hook, torch_join.JoinHook.main_hook),
             (parallel.JoinHook.post_hook, torch_join.JoinHook.post_hook),
             (parallel.Joinable.__init__, torch_join.Joinable.__init__),
             (parallel.Joinable.join_hook, torch_join.Joinable.join_hook),
             (parallel.DistributedDataParallel.join, torch_parallel.DistributedDataParallel.join),
             (parallel.DistributedDataParallel.join_hook, torch_parallel.DistributedDataParallel.join_hook)]
    for ours, theirs in pairs:
        assert _signature(ours) == _signature(theirs), ours.__qualname__
    assert parallel.Joinable.__abstractmethods__ == torch_join.Joinable.__abstractmethods__
    assert issubclass(parallel.DistributedDataParallel, parallel.Joinable)
    for name in ("join_device", "join_process_group"):
        assert isinstance(getattr(parallel.DistributedDataParallel, name), property), name
