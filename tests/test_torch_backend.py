"""Backend "shoal" under torch.distributed's own API: every operation torch dispatches to a backend, at world
sizes 2-4, against a reference computed locally; torch's Work (wait, futures, errors); subgroups."""

from __future__ import annotations

import warnings
from datetime import timedelta

import pytest
import torch

from tests.ranks import run_ranks
from tests.reference import check, data, reference

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]
SIZES = [0, 1, 1031, 300_001]


def _init(rank: int, world: int, port: int, backend: str = "shoal") -> None:
    import torch.distributed as tdist

    import shoal  # noqa: F401 - registers backend "shoal"

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renames of its own functions
    torch.set_num_threads(1)
    tdist.init_process_group(backend, f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                             timeout=timedelta(seconds=60))


def _reductions(rank: int, world: int) -> int:
    import torch.distributed as tdist

    checked = 0
    for dtype in DTYPES:
        bitwise = () if dtype.is_floating_point else ("BAND", "BOR", "BXOR")
        for numel in SIZES:
            for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", *bitwise):
                if numel == SIZES[-1] and op not in ("SUM", "MAX"):
                    continue
                low, high = (1, 3) if op == "PRODUCT" else (0, 4)
                inputs = [data(r, numel, dtype, seed=checked, low=low, high=high) for r in range(world)]
                tensor = inputs[rank].clone()
                tdist.all_reduce(tensor, op=getattr(tdist.ReduceOp, op))
                check(tensor, reference(inputs, op), f"all_reduce {op} {dtype} numel={numel}")
                for root in range(world):
                    tensor = inputs[rank].clone()
                    tdist.reduce(tensor, dst=root, op=getattr(tdist.ReduceOp, op))
                    if rank == root:
                        check(tensor, reference(inputs, op), f"reduce {op} dst={root} {dtype} numel={numel}")
                checked += 1
            # reduce_scatter_tensor: block r of every rank's input, summed, lands on rank r
            inputs = [data(r, numel * world, dtype, seed=checked) for r in range(world)]
            out = torch.empty(numel, dtype=dtype)
            tdist.reduce_scatter_tensor(out, inputs[rank])
            want = reference([t[rank * numel:(rank + 1) * numel] for t in inputs], "SUM")
            check(out, want, f"reduce_scatter_tensor {dtype} numel={numel}")
            out = torch.empty(numel, dtype=dtype)
            tdist.reduce_scatter(out, list(inputs[rank].chunk(world)) if numel else [out.clone()] * world)
            check(out, want, f"reduce_scatter {dtype} numel={numel}")
    # PREMUL_SUM: the sum of the inputs, scaled by the factor, on every reducing op
    premul, scaled = tdist._make_nccl_premul_sum(0.5), 0.5 * sum(range(1, world + 1))
    tensor = torch.full((5,), float(rank + 1))
    tdist.all_reduce(tensor, op=premul)
    check(tensor, torch.full((5,), scaled), "all_reduce PREMUL_SUM")
    tensor = torch.full((5,), float(rank + 1))
    tdist.reduce(tensor, dst=world - 1, op=premul)
    check(tensor, torch.full((5,), scaled if rank == world - 1 else float(rank + 1)), "reduce PREMUL_SUM")
    out = torch.empty(3)
    tdist.reduce_scatter_tensor(out, torch.full((3 * world,), float(rank + 1)), op=premul)
    check(out, torch.full((3,), scaled), "reduce_scatter_tensor PREMUL_SUM")
    tensors = [torch.full((3,), float(rank)), torch.full((2,), 2.0 * rank)]
    tdist.all_reduce_coalesced(tensors)
    total = float(sum(range(world)))
    check(torch.cat(tensors), torch.tensor([total] * 3 + [2 * total] * 2), "all_reduce_coalesced")
    return checked


def _movement(rank: int, world: int) -> int:
    import torch.distributed as tdist

    checked = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool):
        for numel in SIZES:
            inputs = [data(r, numel, dtype, seed=checked, high=2) for r in range(world)]
            out = torch.empty(world * numel, dtype=dtype)
            tdist.all_gather_into_tensor(out, inputs[rank])
            check(out, torch.cat(inputs), f"all_gather_into_tensor {dtype} numel={numel}")
            outs = [torch.empty(numel, dtype=dtype) for _ in range(world)]
            tdist.all_gather(outs, inputs[rank])
            check(torch.cat(outs), torch.cat(inputs), f"all_gather {dtype} numel={numel}")
            for root in range(world):
                tensor = inputs[rank].clone()
                tdist.broadcast(tensor, src=root)
                check(tensor, inputs[root], f"broadcast src={root} {dtype} numel={numel}")
                gathered = [torch.empty(numel, dtype=dtype) for _ in range(world)] if rank == root else None
                tdist.gather(inputs[rank], gathered, dst=root)
                if rank == root:
                    check(torch.cat(gathered), torch.cat(inputs), f"gather dst={root} {dtype} numel={numel}")
                tensor = torch.empty(numel, dtype=dtype)
                tdist.scatter(tensor, [inputs[r] for r in range(world)] if rank == root else None, src=root)
                check(tensor, inputs[rank], f"scatter src={root} {dtype} numel={numel}")
            checked += 1
        # all_to_all_single, uneven: rank r sends j + r + 1 elements of value 10r + j to rank j
        sends = [j + rank + 1 for j in range(world)]
        receives = [rank + j + 1 for j in range(world)]
        ins = torch.cat([torch.full((n,), 10 * rank + j).to(dtype) for j, n in enumerate(sends)])
        out = torch.empty(sum(receives), dtype=dtype)
        tdist.all_to_all_single(out, ins, receives, sends)
        want = torch.cat([torch.full((n,), 10 * j + rank).to(dtype) for j, n in enumerate(receives)])
        check(out, want, f"all_to_all_single {dtype}")
        even = torch.arange(world * 2).to(dtype) + rank
        out = torch.empty_like(even)
        tdist.all_to_all_single(out, even)
        check(out, torch.cat([torch.arange(2 * rank, 2 * rank + 2).to(dtype) + j for j in range(world)]),
              f"all_to_all_single even {dtype}")
        outs = [torch.empty(n, dtype=dtype) for n in receives]
        tdist.all_to_all(outs, list(ins.split(sends)))
        check(torch.cat(outs), want, f"all_to_all {dtype}")
    return checked


def _functional_and_coalesced(rank: int, world: int) -> None:
    """The C++ callers (torch's functional collectives, as DTensor uses them) and the coalesced forms."""
    import torch.distributed as tdist
    import torch.distributed._functional_collectives as funcol

    everyone = tdist.group.WORLD
    mine = [torch.full((2,), float(rank)), torch.full((3,), 10.0 * rank)]
    gathered = funcol.all_gather_into_tensor_coalesced(mine, everyone)
    check(gathered[0], torch.cat([torch.full((2,), float(r)) for r in range(world)]), "all_gather coalesced [0]")
    check(gathered[1], torch.cat([torch.full((3,), 10.0 * r) for r in range(world)]), "all_gather coalesced [1]")
    blocks = [torch.arange(2.0 * world) + rank, torch.ones(world, dtype=torch.float64)]
    reduced = funcol.reduce_scatter_tensor_coalesced(blocks, "sum", [0, 0], everyone)
    check(reduced[0], torch.tensor([2.0 * rank, 2.0 * rank + 1]) * world + sum(range(world)),
          "reduce_scatter_tensor_coalesced")
    check(reduced[1], torch.full((1,), float(world), dtype=torch.float64), "reduce_scatter_tensor_coalesced f64")
    check(funcol.all_reduce(torch.full((2,), 1.0), "sum", everyone), torch.full((2,), float(world)),
          "functional all_reduce")
    check(funcol.all_to_all_single(torch.arange(world * 1.0) + 10 * rank, None, None, everyone),
          torch.tensor([10.0 * r + rank for r in range(world)]), "functional all_to_all_single")
    lists = [[torch.empty(2), torch.empty(1)] for _ in range(world)]  # one list per rank, a tensor per input
    tdist.all_gather_coalesced(lists, [torch.full((2,), float(rank)), torch.full((1,), 5.0 * rank)])
    check(torch.cat([t for per_rank in lists for t in per_rank]),
          torch.cat([torch.tensor([r, r, 5.0 * r]) for r in range(world)]), "all_gather_coalesced")


def _point_to_point_and_work(rank: int, world: int) -> dict:
    import torch.distributed as tdist

    right, left = (rank + 1) % world, (rank - 1) % world
    got = torch.zeros(3)
    works = tdist.batch_isend_irecv([tdist.P2POp(tdist.isend, torch.full((3,), float(rank)), right),
                                     tdist.P2POp(tdist.irecv, got, left)])
    for work in works:
        work.wait()
    check(got, torch.full((3,), float(left)), "batch_isend_irecv")
    if rank == 0:
        tdist.send(torch.arange(4.0), dst=world - 1, tag=3)
    elif rank == world - 1:
        tensor = torch.empty(4)
        tdist.recv(tensor, src=0, tag=3)
        check(tensor, torch.arange(4.0), "send/recv with a tag")
    work = tdist.all_reduce(torch.ones(2), async_op=True)
    future = work.get_future()
    done = future.then(lambda f: f.value()[0] * 10).wait()
    check(done, torch.full((2,), 10.0 * world), "Work.get_future().then")

    def start_another_and_wait(future: torch.futures.Future) -> torch.Tensor:
        """As torch's PowerSGD hook does in its callbacks."""
        another = torch.ones(2)
        tdist.all_reduce(another, async_op=True).get_future().wait()
        return future.value()[0] + another

    done = tdist.all_reduce(torch.ones(2), async_op=True).get_future().then(start_another_and_wait).wait()
    check(done, torch.full((2,), 2.0 * world), "a future's callback that waits for another op")
    assert work.wait(timedelta(seconds=30)) and work.is_completed() and work.is_success() and work.exception() is None
    tdist.barrier()
    objects = [None] * world
    tdist.all_gather_object(objects, {"rank": rank})
    assert objects == [{"rank": r} for r in range(world)]
    with pytest.raises(TypeError, match="BAND takes integer or bool tensors"):
        tdist.all_reduce(torch.ones(1), op=tdist.ReduceOp.BAND)
    return {"backend": tdist.get_backend(), "world": tdist.get_world_size()}


def _subgroups(rank: int, world: int) -> list[float]:
    import torch.distributed as tdist

    seen = []
    odd = tdist.new_group([r for r in range(world) if r % 2])
    everyone = tdist.new_group(list(range(world)))
    tail = tdist.new_group(list(range(1, world)))
    for group, members in ((odd, [r for r in range(world) if r % 2]), (tail, list(range(1, world)))):
        if rank in members:
            tensor = torch.full((2,), float(rank))
            tdist.all_reduce(tensor, group=group)
            seen.append(tensor[0].item())
            root = members[-1]
            tensor = torch.full((2,), float(rank))
            tdist.broadcast(tensor, src=root, group=group)  # src: a global rank, as torch takes it
            seen.append(tensor[0].item())
            tdist.reduce_scatter_tensor(out := torch.empty(1), torch.ones(len(members)), group=group)
            seen.append(out.item())
    tensor = torch.ones(1)
    tdist.all_reduce(tensor, group=everyone)
    seen.append(tensor.item())
    return seen


def _everything(rank: int, world: int, port: int) -> dict:
    import torch.distributed as tdist

    _init(rank, world, port)
    try:
        _functional_and_coalesced(rank, world)
        out = {"reductions": _reductions(rank, world), "movement": _movement(rank, world),
               "p2p": _point_to_point_and_work(rank, world), "subgroups": _subgroups(rank, world)}
    finally:
        tdist.destroy_process_group()
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_dispatched_op_equals_the_reference(world: int) -> None:
    out = run_ranks(_everything, world, backend=None, timeout=240)
    for rank in range(world):
        assert out[rank]["reductions"] > 0 and out[rank]["movement"] > 0
        assert out[rank]["p2p"] == {"backend": "shoal", "world": world}
        odd = [r for r in range(world) if r % 2]
        tail = list(range(1, world))
        want = []
        for members in (odd, tail):
            if rank in members:
                want += [float(sum(members)), float(members[-1]), float(len(members))]
        assert out[rank]["subgroups"] == [*want, float(world)]


def _first_op_under(rank: int, world: int, port: int, backend: str) -> dict:
    import torch.distributed as tdist

    from shoal.comm.as_torch.work import TorchWork

    _init(rank, world, port, backend)
    try:
        tensor = torch.full((4,), float(rank + 1))
        work = tdist.all_reduce(tensor, async_op=True)
        work.wait()
        return {"sum": tensor.tolist(), "on shoal": isinstance(work, TorchWork)}
    except ValueError as exc:
        return {"error": str(exc)}
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize(("backend", "refused"), [
    ("cpu:shoal,cuda:nccl", None),
    ("cpu:gloo,cuda:shoal", "backend 'shoal' in a map must take the CPU"),
    ("cpu:shoal,cuda:gloo", "cuda tensors beside shoal go to 'shoal' or 'nccl', not 'gloo'"),
])
def test_a_device_map_gives_shoal_the_cpu_and_refuses_what_it_cannot_build(backend: str, refused: str | None) -> None:
    """(tests/test_cuda.py runs the map's CUDA half, where there is a GPU.)"""
    out = run_ranks(_first_op_under, 2, backend, backend=None, timeout=60)
    for rank in range(2):
        if refused:
            assert refused in out[rank]["error"]
        else:
            assert out[rank] == {"sum": [3.0] * 4, "on shoal": True}
