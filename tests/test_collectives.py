"""Every collective and point-to-point op on real processes, against a reference computed locally,
for world sizes 1-4, several dtypes and sizes (0, 1, odd, large), on backends "shoal" and "gloo"."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.ranks import run_ranks
from tests.reference import check, data, reference

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8]
# 0, 1, odd, and large enough for the pipelined ring path (several chunks per segment for float64).
SIZES = [0, 1, 1031, 700_001]


def _all_reduce_cases(rank: int, world: int, backend: str) -> int:
    import shoal.distributed as dist

    checked = 0
    for dtype in DTYPES:
        for numel in SIZES:
            bitwise = () if dtype.is_floating_point else ("BAND", "BOR", "BXOR")
            for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", *bitwise):
                if numel == SIZES[-1] and op not in ("SUM", "AVG", "MAX", "BXOR"):
                    continue  # big tensors: one of each kind of reduction is enough
                if backend == "gloo" and dtype in (torch.float16, torch.bfloat16) and op == "PRODUCT":
                    continue  # gloo's own limitation, not ours
                low, high = (1, 3) if op == "PRODUCT" else (0, 4)
                inputs = [data(r, numel, dtype, seed=checked, low=low, high=high) for r in range(world)]
                tensor = inputs[rank].clone()
                dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
                check(tensor, reference(inputs, op), f"all_reduce {op} {dtype} numel={numel}")
                checked += 1
    return checked


def _rooted_and_gathering_cases(rank: int, world: int) -> int:
    import shoal.distributed as dist

    checked = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        for numel in SIZES:
            inputs = [data(r, numel, dtype, seed=checked) for r in range(world)]
            for root in range(world):
                t = inputs[rank].clone()
                dist.broadcast(t, src=root)
                check(t, inputs[root], f"broadcast root={root} {dtype} numel={numel}")

                t = inputs[rank].clone()
                dist.reduce(t, dst=root, op=dist.ReduceOp.SUM)
                if rank == root:
                    check(t, reference(inputs, "SUM"), f"reduce dst={root} {dtype} numel={numel}")

                out = [torch.empty_like(inputs[0]) for _ in range(world)] if rank == root else None
                dist.gather(inputs[rank], out, dst=root)
                if rank == root:
                    for r in range(world):
                        check(out[r], inputs[r], f"gather dst={root} from {r} {dtype} numel={numel}")

                t = torch.empty_like(inputs[0])
                blocks = [inputs[root] + r for r in range(world)] if rank == root else None
                dist.scatter(t, blocks, src=root)
                check(t, inputs[root] + rank, f"scatter src={root} {dtype} numel={numel}")
            outs = [torch.empty_like(inputs[0]) for _ in range(world)]
            dist.all_gather(outs, inputs[rank])
            for r in range(world):
                check(outs[r], inputs[r], f"all_gather block {r} {dtype} numel={numel}")

            blocks = [data(rank, numel, dtype, seed=checked + 7 * j) for j in range(world)]
            out = torch.empty_like(inputs[0])
            dist.reduce_scatter(out, blocks)
            want = reference([data(r, numel, dtype, seed=checked + 7 * rank) for r in range(world)], "SUM")
            check(out, want, f"reduce_scatter {dtype} numel={numel}")

            ins = [torch.full((rank + j,), rank * 10 + j).to(dtype) for j in range(world)]
            outs = [torch.empty(j + rank, dtype=dtype) for j in range(world)]
            dist.all_to_all(outs, ins)
            for j in range(world):
                check(outs[j], torch.full((j + rank,), j * 10 + rank).to(dtype), f"all_to_all from {j} {dtype}")
            dist.barrier()
            checked += 1
    return checked


def _everything(rank: int, world: int, backend: str) -> int:
    return _all_reduce_cases(rank, world, backend) + _rooted_and_gathering_cases(rank, world)


# "shoal" takes shared memory between ranks on one host; SHOAL_SHM=0 keeps it to the ring, as between hosts.
@pytest.mark.parametrize(("backend", "env"), [("shoal", {}), ("shoal", {"SHOAL_SHM": "0"}), ("gloo", {})],
                         ids=["shoal", "shoal-ring", "gloo"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives_match_reference(backend: str, env: dict[str, str], world: int) -> None:
    counts = run_ranks(_everything, world, backend, backend=backend, timeout=300, env=env)
    assert len(set(counts.values())) == 1 and counts[0] > 0


def _non_contiguous(rank: int, world: int) -> None:
    import shoal.distributed as dist

    base = torch.arange(24, dtype=torch.float64).reshape(4, 6) * (rank + 1)
    view = base.t()  # not contiguous: reduced through a staging copy and written back
    dist.all_reduce(view)
    want = torch.arange(24, dtype=torch.float64).reshape(4, 6) * sum(range(1, world + 1))
    assert torch.equal(base, want)
    column = torch.zeros(4, 3, dtype=torch.float64)[:, 1]
    if rank == 0:
        dist.send(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64), dst=1)
    else:
        dist.recv(column, src=0)
        assert torch.equal(column, torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))


@pytest.mark.parametrize("backend", ["shoal", "gloo"])
def test_non_contiguous_tensors_are_handled(backend: str) -> None:
    run_ranks(_non_contiguous, 2, backend=backend)


def _coalesced(rank: int, world: int) -> None:
    import shoal.distributed as dist

    total = 2_621_443  # two and a half rounds of the shared-memory window (float32): pieces cross them
    for seed, op in enumerate(("SUM", "AVG", "MAX")):
        inputs = [data(r, total, torch.float32, seed=seed) for r in range(world)]
        whole = inputs[rank].clone()
        reduce_op = getattr(dist.ReduceOp, op)
        if rank == 0:  # the same collective as the others' coalesced calls, whatever their cuts
            dist.all_reduce(whole, op=reduce_op)
        else:
            gen = torch.Generator().manual_seed(rank)
            cuts = sorted(torch.randint(1, total - 7, (4,), generator=gen).tolist())
            bounds = [0, *cuts, cuts[-1], total - 7]  # one piece empty
            tail = torch.zeros(7, 2)[:, 0]  # not contiguous: reduced through a copy and written back
            tail.copy_(whole[total - 7:])
            dist.all_reduce_coalesced([whole[a:b] for a, b in itertools.pairwise(bounds)] + [tail],
                                      op=reduce_op)
            whole[total - 7:] = tail
        check(whole, reference(inputs, op), f"all_reduce_coalesced {op}")
    small = [data(r, 1000, torch.int64, seed=7) for r in range(world)]  # one round: everyone reduces all
    pieces = small[rank].clone()
    dist.all_reduce_coalesced([pieces[:10], pieces[10:10], pieces[10:999], pieces[999:]], op=dist.ReduceOp.AVG)
    check(pieces, reference(small, "AVG"), "all_reduce_coalesced AVG int64, small")
    shared = data(rank, total, torch.float32, seed=8)  # twice the same memory: as if packed, each gets the sum
    dist.all_reduce_coalesced([shared, shared])
    check(shared, reference([data(r, total, torch.float32, seed=8) for r in range(world)], "SUM"),
           "all_reduce_coalesced of one tensor twice")
    with pytest.raises(ValueError, match="must match"):
        dist.all_reduce_coalesced([torch.ones(2), torch.ones(2, dtype=torch.int64)])


@pytest.mark.parametrize(("backend", "env"), [("shoal", {}), ("shoal", {"SHOAL_SHM": "0"}), ("gloo", {})],
                         ids=["shoal", "shoal-ring", "gloo"])
@pytest.mark.parametrize("world", [2, 3])
def test_coalesced_all_reduce_works_where_tensors_lie_and_pairs_with_all_reduce(
        backend: str, env: dict[str, str], world: int) -> None:
    run_ranks(_coalesced, world, backend=backend, timeout=120, env=env)


def _large_without_lanes(rank: int, world: int) -> None:
    import shoal.distributed as dist

    t = torch.arange(3_000_001, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    assert torch.equal(t, torch.arange(3_000_001, dtype=torch.float32) * sum(range(1, world + 1)))
    t = torch.full((3_000_001,), float(rank))
    dist.broadcast(t, src=world - 1)
    assert torch.all(t == world - 1)


def test_large_collectives_over_plain_tcp() -> None:
    # SHOAL_SHM=0: no shared-memory lanes, as between hosts; every byte goes through the sockets.
    run_ranks(_large_without_lanes, 3, env={"SHOAL_SHM": "0"})
