"""Several TCP connections per pair of ranks (SHOAL_STREAMS): large frames go round them, every result is
the same as over one, a frame sent just before its sender leaves still arrives, the connections heal
like one, and ranks that disagree on the number, or on a frame's size and so on its parts, are told so."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch

import shoal.distributed as dist
from shoal.comm.transport import striping
from shoal.comm.transport.frames import Op, Recv
from shoal.errors import CollectiveMismatchError, PeerFailure
from tests.ranks import run_ranks

_STREAMS = {"SHOAL_STREAMS": "3", "SHOAL_SHM": "0"}  # SHOAL_SHM=0: between ranks as between hosts


def _frames_per_stream(peer: int) -> list[int]:
    links = dist.default_group().transport._links
    return [links[peer, s]._next_number - 1 for s in range(3)]


def _collectives_over_streams(rank: int, world: int) -> list[int] | None:
    numel = 3_000_001  # many 2 MiB chunks per ring step
    t = torch.arange(numel, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(t)
    assert torch.equal(t, torch.arange(numel, dtype=torch.float64) * sum(range(1, world + 1)))
    b = torch.arange(numel, dtype=torch.float32) if rank == 1 else torch.zeros(numel)
    dist.broadcast(b, src=1)
    assert torch.equal(b, torch.arange(numel, dtype=torch.float32))
    outs = [torch.empty(1_000_003, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(outs, torch.full((1_000_003,), rank, dtype=torch.int64))
    assert all(torch.equal(o, torch.full_like(o, r)) for r, o in enumerate(outs))
    # Point to point: messages of one tag spread over the connections, and still pair up in order.
    if rank == 0:
        works = [dist.isend(torch.full((500_000,), float(i)), dst=1) for i in range(6)]
        for work in works:
            work.wait()
    elif rank == 1:
        for i in range(6):
            got = torch.empty(500_000)
            dist.recv(got, src=0)
            assert torch.equal(got, torch.full_like(got, float(i))), f"message {i} out of order"
    dist.barrier()
    # One frame of 2 MiB (a broadcast's one chunk, from rank 0 to rank 1) goes in parts, one per stream.
    before = _frames_per_stream(1) if rank == 0 else None
    one_chunk = torch.full((1 << 19,), 7.0) if rank == 0 else torch.empty(1 << 19)
    dist.broadcast(one_chunk, src=0)
    assert torch.equal(one_chunk, torch.full_like(one_chunk, 7.0))
    return None if before is None else [b - a for a, b in zip(before, _frames_per_stream(1), strict=True)]


def test_large_frames_go_round_every_stream_with_the_results_of_one() -> None:
    parts = run_ranks(_collectives_over_streams, 3, env=_STREAMS, timeout=120)[0]
    assert parts == [1, 1, 1], f"rank 0's one frame to rank 1 went as {parts} frames per stream"


def _send_and_leave(rank: int, world: int) -> None:
    big = 8_000_000
    if rank == 0:  # messages not waited for: the goodbye follows them; the second goes on another stream
        dist.isend(torch.zeros(1), dst=1)
        dist.isend(torch.arange(big, dtype=torch.float32), dst=1)
        dist.destroy_process_group()
        return
    dist.recv(torch.empty(1), src=0)
    transport = dist.default_group().transport
    while transport.failure(0) is None:  # told that rank 0 left: its frames must all be here by now
        time.sleep(0.001)
    got = torch.empty(big)
    dist.recv(got, src=0)
    assert torch.equal(got, torch.arange(big, dtype=torch.float32))


def test_a_frame_sent_on_another_stream_just_before_leaving_arrives() -> None:
    for _ in range(3):
        run_ranks(_send_and_leave, 2, env=_STREAMS, timeout=60)


def _all_reduce_while_severed(rank: int, world: int) -> int:
    transport = dist.default_group().transport
    for i in range(8):
        t = torch.arange(2_000_003, dtype=torch.float64) + rank + i
        work = dist.all_reduce(t, async_op=True)
        transport.sever(1 - rank)  # every connection to the peer drops mid-operation
        work.wait()
        assert torch.equal(t, 2 * torch.arange(2_000_003, dtype=torch.float64) + 1 + 2 * i), f"round {i}"
    return i + 1


def test_every_stream_heals_with_each_result_right() -> None:
    assert run_ranks(_all_reduce_while_severed, 2, env=_STREAMS, timeout=120) == {0: 8, 1: 8}


def _disagree(rank: int, world: int, port: int) -> None:
    os.environ["SHOAL_STREAMS"] = str(rank + 1)
    dist.init_process_group("shoal", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=10))


def _disagree_and_say(rank: int, world: int, port: int) -> str:
    try:
        _disagree(rank, world, port)
    except (ValueError, TimeoutError) as exc:
        return str(exc)
    return "connected"


def test_ranks_that_disagree_on_the_number_of_streams_are_told_so() -> None:
    said = run_ranks(_disagree_and_say, 2, backend=None, env={"SHOAL_SHM": "0"}, timeout=60)
    assert "keeps 2 connection(s) to each other rank, and rank 0 keeps 1: SHOAL_STREAMS must be" in said[1]
    assert ("rank 1's connection was refused: this rank keeps 1 connection(s) to each other rank, and rank 1 "
            "keeps 2" in said[0])


def _all_to_all_of_other_sizes(rank: int, world: int, sent: int, expected: int) -> str:
    """Rank 1 expects `expected` elements from rank 0, which sends `sent`; every other block agrees."""
    outs = [torch.empty(expected if (rank, src) == (1, 0) else sent) for src in range(world)]
    try:
        dist.all_to_all(outs, [torch.full((sent,), float(rank)) for _ in range(world)])
        said = "done"  # rank 0 may finish first: what it received was right
    except CollectiveMismatchError as exc:
        said = str(exc)
    survivor = torch.ones(4)
    dist.all_reduce(survivor)  # the group stays usable
    assert torch.equal(survivor, torch.full((4,), float(world)))
    return said


@pytest.mark.parametrize(("sent", "expected"), [(100_000, 300_000), (300_000, 100_000)])
def test_a_block_of_another_size_cut_into_other_parts_is_a_mismatch(sent: int, expected: int) -> None:
    """400 KB go in one part and 1.2 MB in three: the parts' numbers differ, and the receiver must not wait."""
    said = run_ranks(_all_to_all_of_other_sizes, 2, sent, expected, env=_STREAMS, timeout=60, group_timeout=30)
    assert "rank 1 called all_to_all" in said[1] and "rank 0 sent a frame of a different size" in said[1], said
    assert said[0] == "done" or said[0] == said[1], said


def test_a_frame_is_cut_alike_from_its_size_and_its_parts_are_numbered_apart() -> None:
    assert striping.cuts(64 << 10, 4) == [0, 64 << 10]  # small: whole
    assert striping.cuts(4 << 20, 4) == [0, 1 << 20, 2 << 20, 3 << 20, 4 << 20]
    assert striping.cuts(600 << 10, 4) == [0, 300 << 10, 600 << 10]  # no part under PART_MIN
    assert striping.cuts(4 << 20, 1) == [0, 4 << 20]
    numbers = {striping.part_sub(sub, part, parts) for sub in range(100) for parts in range(1, 9)
               for part in range(parts)}
    assert len(numbers) == 100 * 36 and max(numbers) < 1 << 30  # below placement's record numbers
    assert striping.part_sub(5, 0, 1) == 5
    assert len({striping.spread(7, striping.part_sub(3, part, 4)) % 4 for part in range(4)}) == 4
    with pytest.raises(ValueError, match="too large to be striped"):
        striping.part_sub(1 << 24, 1, 2)
    # Where a frame's two ends cut it differently, their first parts are found from either.
    assert striping.first_parts_of_other_cuts(5, 3) == [striping.part_sub(5, 0, 2), striping.part_sub(5, 0, 3)]
    assert striping.first_parts_of_other_cuts(striping.part_sub(5, 0, 2), 3) == [5, striping.part_sub(5, 0, 3)]
    assert striping.first_parts_of_other_cuts(striping.part_sub(5, 1, 2), 3) == []  # not a first part
    assert striping.first_parts_of_other_cuts((1 << 31) + 5, 3) == []  # placement's numbers are never parts


def _striped(process) -> tuple[Recv, list[Recv]]:
    op = Op(0, -1, 0, (0, 0, 0, 0, 0), (0, 1), timedelta(seconds=5), "all_reduce", str)
    whole = Recv(op, 1, 0, memoryview(bytearray(8)), process, None)
    done = striping.gather(whole, 3)
    return whole, [Recv(op, 1, striping.part_sub(0, p, 3), memoryview(bytearray(1)), None, done) for p in range(3)]


def test_a_striped_frame_is_processed_once_all_its_parts_are_in_and_fails_with_its_first_failed_part() -> None:
    processed = []
    whole, parts = _striped(lambda: processed.append(True))
    parts[2].finish()
    parts[0].finish()
    assert not whole.event.is_set() and not processed
    parts[1].finish()
    assert whole.event.is_set() and whole.error is None and processed == [True]

    whole, parts = _striped(lambda: processed.append(False))
    parts[1].finish(PeerFailure(1, "gone"))
    assert whole.event.is_set() and isinstance(whole.error, PeerFailure)
    parts[0].finish()
    parts[2].finish(PeerFailure(1, "gone"))
    assert processed == [True]  # a failed frame is never processed
