"""Receiving from any source (`recv(src=None)`, torch's `recv_anysource`, `recv_object_list`): each
receive takes the first message with its tag from whichever rank sends it and names that rank; receives
issued behind one take the messages after it, in order; a rank that leaves is passed over while others may
still send; on shoal's own backend, on its gloo one, and through torch's API on backend "shoal"."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from shoal.comm.transport.frames import Op, Recv
from shoal.comm.transport.matching import Matcher
from shoal.errors import PeerFailure
from tests.ranks import run_ranks

SIG = (9, 0, 0, 0, 4)  # a receive of four float32s


def _candidates(seqs: dict[int, int], buffer: bytearray, done: list) -> list[Recv]:
    return [Recv(Op(0, 7, seq, SIG, (src,), timedelta(seconds=10), "recv", str), src, 0, memoryview(buffer), None,
                 done.append) for src, seq in seqs.items()]


def _deliver(matcher: Matcher, src: int, seq: int, data: bytes) -> None:
    arrival = matcher.arrive(src, (0, 7, seq), 0, SIG, len(data))
    arrival.view[:] = data
    arrival.done()


def test_the_first_frame_to_arrive_is_taken_and_the_other_sources_are_withdrawn() -> None:
    matcher, buffer, done = Matcher(0, lambda op, error: None), bytearray(16), []
    matcher.post_first(_candidates({1: 0, 2: 3}, buffer, done))
    _deliver(matcher, 2, 3, bytes(range(16)))
    assert [r.src for r in done] == [2] and done[0].error is None and bytes(buffer) == bytes(range(16))
    _deliver(matcher, 1, 0, bytes(16))  # rank 1's message waits for the receive that will number it
    assert len(done) == 1 and bytes(buffer) == bytes(range(16))
    later, late = bytearray(16), []
    matcher.post_first(_candidates({1: 0, 2: 4}, later, late))
    assert [r.src for r in late] == [1]


def test_of_frames_already_here_the_earliest_is_taken() -> None:
    matcher, buffer, done = Matcher(0, lambda op, error: None), bytearray(16), []
    _deliver(matcher, 2, 0, bytes([2] * 16))
    _deliver(matcher, 1, 0, bytes([1] * 16))
    matcher.post_first(_candidates({1: 0, 2: 0}, buffer, done))
    assert [r.src for r in done] == [2] and bytes(buffer) == bytes([2] * 16)


def test_a_lost_source_is_passed_over_until_none_is_left() -> None:
    matcher, buffer, done = Matcher(0, lambda op, error: None), bytearray(16), []
    matcher.post_first(_candidates({1: 0, 2: 0}, buffer, done))
    matcher.peer_departed(1)
    assert done == []
    error, _ = matcher.peer_lost(2, "killed")
    assert len(done) == 1 and done[0].error is error
    with pytest.raises(PeerFailure):  # posted when every source is gone
        matcher.post_first(_candidates({1: 1, 2: 1}, bytearray(16), []))


def test_a_receive_from_any_source_fails_once_as_a_whole() -> None:
    """Closing, or an abort of an ident its candidates share (each peer's message 0 on a fresh tag), settles
    it once, and withdraws every candidate: a later frame is held for the next receive."""
    for end in ("close", "abort"):
        matcher, buffer, done = Matcher(0, lambda op, error: None), bytearray(16), []
        matcher.post_first(_candidates({1: 0, 2: 0}, buffer, done))
        if end == "close":
            matcher.close()
        else:
            matcher.fail_op((0, 7, 0), RuntimeError("aborted"), 1)
        assert len(done) == 1 and done[0].error is not None and not done[0].taken
        if end == "abort":
            _deliver(matcher, 2, 1, bytes(16))
            assert len(done) == 1


def test_a_frame_that_disagrees_is_still_taken() -> None:
    """Its sender's next message is then numbered after it, as the sender numbered it."""
    aborted: list = []
    matcher, done = Matcher(0, lambda op, error: aborted.append(error)), []
    matcher.post_first(_candidates({1: 0, 2: 0}, bytearray(16), done))
    arrival = matcher.arrive(2, (0, 7, 0), 0, SIG, 8)  # half the size posted
    arrival.view[:] = bytes(8)
    arrival.done()
    assert len(done) == 1 and done[0].taken and done[0].src == 2 and "different size" in str(done[0].error)


def _exchange(rank: int, world: int, behind: bool) -> list:
    """Rank 0 receives from any source what the others send with tag 5, and (`behind`) with tag 7, with a
    receive from rank 2 between two from any source; returns (sender, value) pairs in receiving order."""
    import shoal.distributed as dist

    got = []
    if rank == 0:
        for _ in range(world - 1):
            t = torch.empty(3)
            src = dist.recv(t, tag=5)
            got.append((src, t.tolist()))
        for _ in range(world - 1):
            objects = [None, None]
            src = dist.recv_object_list(objects)
            got.append((src, objects))
        if not behind:
            return got
        first, second, third = torch.empty(3), torch.empty(3), torch.empty(3)
        works = [dist.irecv(first, tag=7), dist.irecv(second, src=2, tag=7), dist.irecv(third, tag=7)]
        dist.barrier()  # only now do the others send
        for w in works:
            w.wait()
        got += [(works[0].source_rank(), first.tolist()), (2, second.tolist()),
                (works[2].source_rank(), third.tolist())]
        with pytest.raises(ValueError, match="sender is known only"):
            works[1].source_rank()
    else:
        dist.send(torch.full((3,), float(rank)), dst=0, tag=5)
        dist.send_object_list([{"from": rank}, "x" * 100 * rank], dst=0)
        if not behind:
            return got
        dist.barrier()
        if rank == 2:  # two messages; the receive from any source posted first takes the first
            dist.send(torch.full((3,), 20.0), dst=0, tag=7)
            dist.send(torch.full((3,), 21.0), dst=0, tag=7)
        else:
            dist.send(torch.full((3,), 10.0), dst=0, tag=7)
    dist.barrier()
    return got


@pytest.mark.parametrize("backend", ["shoal", "gloo"])
def test_a_receive_from_any_source_names_each_sender(backend: str) -> None:
    got = run_ranks(_exchange, 3, False, backend=backend, timeout=90)[0]
    assert sorted(got[:2]) == [(1, [1.0] * 3), (2, [2.0] * 3)]
    assert sorted(got[2:], key=lambda g: g[0]) == [(r, [{"from": r}, "x" * 100 * r]) for r in (1, 2)]


def test_receives_issued_behind_one_from_any_source_take_the_messages_after_it() -> None:
    """torch's gloo does not keep this order: there the receive from rank 2 may take its first message."""
    got = run_ranks(_exchange, 3, True, timeout=90)[0][4:]
    # Whichever sender the first receive takes, the one from rank 2 behind it takes rank 2's next message,
    # and the last takes what is left.
    assert got in ([(1, [10.0] * 3), (2, [20.0] * 3), (2, [21.0] * 3)],
                       [(2, [20.0] * 3), (2, [21.0] * 3), (1, [10.0] * 3)])


def _torch_any(rank: int, world: int, port: int) -> list:
    import torch.distributed as tdist

    import shoal  # noqa: F401 - registers backend "shoal"

    tdist.init_process_group("shoal", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                             timeout=timedelta(seconds=60))
    got = []
    if rank == 0:
        for _ in range(world - 1):
            t = torch.empty(2, dtype=torch.int64)
            got.append((tdist.recv(t, tag=3), t.tolist()))
        odd = tdist.new_group([0, 2])
        t = torch.empty(2, dtype=torch.int64)
        work = tdist.irecv(t, group=odd, tag=4)
        work.wait()
        got.append((work._source_rank(), t.tolist()))  # the group's rank, as torch gives it
    else:
        tdist.send(torch.tensor([rank, rank * 10]), dst=0, tag=3)
        odd = tdist.new_group([0, 2])
        if rank == 2:
            tdist.send(torch.tensor([7, 8]), dst=0, group=odd, tag=4)
    tdist.destroy_process_group()
    return got


def test_torchs_recv_without_src_on_backend_shoal_returns_the_sender() -> None:
    got = run_ranks(_torch_any, 3, backend=None, timeout=90)[0]
    assert sorted(got[:2]) == [(1, [1, 10]), (2, [2, 20])] and got[2] == (1, [7, 8])


def _left(rank: int, world: int) -> str:
    import shoal.distributed as dist

    if rank == 0:
        t = torch.empty(1)
        work = dist.irecv(t, tag=1)
        dist.barrier()  # posted before rank 2 leaves
        assert work.wait() and (work.source_rank(), t.item()) == (1, 1.0)
        with pytest.raises(PeerFailure) as caught:
            dist.recv(t, tag=1)  # the others have left: nobody can send
        return str(caught.value)
    dist.barrier()
    if rank == 1:
        dist.send(torch.ones(1), dst=0, tag=1)
    dist.destroy_process_group()
    return ""


def test_a_rank_that_leaves_is_passed_over_and_the_last_one_ends_the_receive() -> None:
    assert "left the group" in run_ranks(_left, 3, timeout=90)[0]


def _pending_then_mismatch(rank: int, world: int) -> str:
    """Rank 0: a receive from any source that disagrees with the message it takes fails alone, and the
    next takes that sender's next message; one still waiting when the group is destroyed fails, and the
    destroy returns."""
    import shoal.distributed as dist
    from shoal.errors import CollectiveMismatchError

    if rank == 0:
        with pytest.raises(CollectiveMismatchError, match="rank 1 sent send/recv"):
            dist.recv(torch.empty(2), tag=3)
        t = torch.empty(2)
        assert dist.recv(t, tag=3) == 1 and t.tolist() == [5.0, 5.0]
        work = dist.irecv(torch.empty(1), tag=9)  # nobody sends it
        dist.barrier()
        dist.destroy_process_group()
        with pytest.raises(Exception) as caught:
            work.wait()
        return type(caught.value).__name__
    if rank == 2:  # a third rank, whose message 0 on tag 3 is another than rank 1's
        dist.barrier()
        return ""
    try:
        dist.send(torch.ones(3), dst=0, tag=3)
    except CollectiveMismatchError:
        pass  # the receiver's abort may reach the send before its acknowledgement does
    dist.send(torch.full((2,), 5.0), dst=0, tag=3)
    dist.barrier()
    return ""


def test_a_disagreeing_message_and_a_destroyed_group_end_a_receive_from_any_source() -> None:
    assert run_ranks(_pending_then_mismatch, 3, timeout=90)[0] == "GroupBrokenError"
