"""Matching arriving frames to posted receives, without sockets: posted first or arrived first, the
same bytes land in the same place; disagreeing frames abort; withdrawn and failed ones are dropped."""

from __future__ import annotations

from datetime import timedelta

import pytest

from shoal.comm.transport import striping
from shoal.comm.transport.frames import Op, Recv
from shoal.comm.transport.matching import Matcher
from shoal.errors import CollectiveMismatchError, GroupBrokenError, PeerFailure

SIG = (1, 0, 0, 0, 4)  # an all-reduce of four float32s


def _op(seq: int = 1, sig: tuple = SIG) -> Op:
    return Op(0, -1, seq, sig, (0, 1), timedelta(seconds=10), "test op", lambda s: f"op{s}")  # a collective


def _matcher(*, streams: int = 1) -> tuple[Matcher, list]:
    aborted: list = []
    matcher = Matcher(0, lambda op, error: (aborted.append(error), matcher.fail_op(op.ident, error, op.ranks[0])),
                      streams=streams)
    return matcher, aborted


def _in_op() -> tuple[Matcher, list, Op]:
    """A matcher in which one op (the default `_op()`) has begun, and the errors it aborted ops with."""
    matcher, aborted = _matcher()
    op = _op()
    matcher.begin(op)
    return matcher, aborted, op


def _deliver(matcher: Matcher, op: Op, data: bytes, sig: tuple = SIG) -> None:
    arrival = matcher.arrive(1, op.ident, 0, sig, len(data))
    arrival.view[:] = data
    arrival.done()


def _post(matcher: Matcher, op: Op, nbytes: int = 16) -> tuple[Recv, bytearray]:
    buffer = bytearray(nbytes)
    recv = Recv(op, 1, 0, memoryview(buffer), None, None)
    matcher.post(recv)
    return recv, buffer


def test_a_posted_receive_gets_the_frame_in_its_own_buffer() -> None:
    matcher, _, op = _in_op()
    recv, buffer = _post(matcher, op)
    arrival = matcher.arrive(1, op.ident, 0, SIG, 16)
    assert arrival.view.obj is buffer  # zero-copy: the frame is read straight into the posted buffer
    arrival.view[:] = bytes(range(16))
    arrival.done()
    assert recv.event.is_set() and recv.error is None and bytes(buffer) == bytes(range(16))


def test_a_frame_that_comes_first_is_held_until_its_receive_is_posted() -> None:
    matcher, _, op = _in_op()
    _deliver(matcher, op, bytes(range(16)))
    recv, buffer = _post(matcher, op)
    assert recv.event.is_set() and recv.error is None and bytes(buffer) == bytes(range(16))


def test_a_receive_posted_while_its_frame_is_read_in_gets_it_when_complete() -> None:
    matcher, _, op = _in_op()
    arrival = matcher.arrive(1, op.ident, 0, SIG, 16)
    recv, buffer = _post(matcher, op)
    assert not recv.event.is_set()
    arrival.view[:] = bytes(range(16))
    arrival.done()
    assert recv.event.is_set() and bytes(buffer) == bytes(range(16))


def test_a_frame_withdrawn_while_it_is_read_in_is_dropped_quietly() -> None:
    matcher, aborted, op = _in_op()
    arrival = matcher.arrive(1, op.ident, 0, SIG, 16)
    recv, buffer = _post(matcher, op)
    matcher.end(op)  # a mismatch elsewhere ended the op while the frame was still coming in
    arrival.view[:] = bytes(range(16))
    arrival.done()
    assert not recv.event.is_set() and bytes(buffer) == bytes(16) and aborted == []
    assert matcher.failure(1) is None


@pytest.mark.parametrize("posted_first", [True, False])
def test_a_frame_of_another_collective_aborts_the_op(posted_first: bool) -> None:
    matcher, aborted, op = _in_op()
    other = (2, 0, 0, 0, 4)  # a broadcast where we called an all-reduce
    if posted_first:
        recv, _ = _post(matcher, op)
        _deliver(matcher, op, bytes(16), other)
        assert recv.error is aborted[0]
    else:
        _deliver(matcher, op, bytes(16), other)
    assert len(aborted) == 1 and "rank 1 sent op(2, 0, 0, 0, 4)" in str(aborted[0])
    with pytest.raises(CollectiveMismatchError):
        matcher.check_usable(op)


def test_a_frame_of_another_size_is_named_as_such() -> None:
    matcher, _ = _matcher()
    op = _op()
    recv, _ = _post(matcher, op, nbytes=8)
    _deliver(matcher, op, bytes(16))
    assert "a frame of a different size" in str(recv.error)


@pytest.mark.parametrize("posted_first", [True, False])
@pytest.mark.parametrize(("sent_in", "posted_in"), [(1, 3), (3, 1), (2, 3)])
def test_a_frame_cut_into_other_parts_than_its_receive_is_a_mismatch(posted_first: bool, sent_in: int,
                                                                      posted_in: int) -> None:
    """With several connections a frame goes in parts, numbered by how many there are: a sender and a
    receiver that disagree on its size cut it differently, and must hear so rather than wait."""
    matcher, aborted = _matcher(streams=3)
    op = _op()
    matcher.begin(op)
    recvs = [Recv(op, 1, striping.part_sub(5, part, posted_in), memoryview(bytearray(8)), None, None)
             for part in range(posted_in)]
    raised = {}  # the parts whose posting raised, the op being over by then

    def post() -> None:
        for recv in recvs:
            try:
                matcher.post(recv)
            except CollectiveMismatchError as exc:
                raised[recv] = exc

    if posted_first:
        post()
    for part in reversed(range(sent_in)):  # the first part last: the others, held, betray nothing
        matcher.arrive(1, op.ident, striping.part_sub(5, part, sent_in), SIG, 8).done()
    if not posted_first:
        post()
    assert len(aborted) == 1 and "a frame of a different size" in str(aborted[0])
    assert all(raised.get(recv, recv.error) is aborted[0] for recv in recvs)


def test_a_lost_peer_fails_what_waits_on_it_and_what_it_takes_part_in() -> None:
    matcher, _, op = _in_op()
    recv, _ = _post(matcher, op)
    error, first = matcher.peer_lost(1, "connection lost")
    assert first and recv.error is error and isinstance(error, PeerFailure) and error.rank == 1
    assert matcher.peer_lost(1, "again") == (error, False)
    with pytest.raises(PeerFailure):
        matcher.check_usable(_op(seq=2))


def test_a_departed_peer_still_delivers_what_it_sent_before_leaving() -> None:
    matcher, _, op = _in_op()
    _deliver(matcher, op, bytes(range(16)))
    matcher.peer_departed(1)
    recv, buffer = _post(matcher, op)
    assert recv.error is None and bytes(buffer) == bytes(range(16))
    with pytest.raises(PeerFailure, match="left the group"):
        _post(matcher, _op(seq=2))


def test_closing_fails_every_waiting_receive() -> None:
    matcher, _ = _matcher()
    recv, _ = _post(matcher, _op())
    matcher.close()
    assert isinstance(recv.error, GroupBrokenError)
    with pytest.raises(GroupBrokenError, match="closed"):
        matcher.check_usable(_op(seq=2))


def test_a_message_to_a_peer_is_refused_once_the_peer_is_gone_or_the_transport_closed() -> None:
    matcher, _ = _matcher()
    matcher.check_peer(1)  # a member: nothing to refuse
    lost, _ = matcher.peer_lost(1, "its process died")
    with pytest.raises(PeerFailure) as refused:
        matcher.check_peer(1)
    assert refused.value is lost
    departed = matcher.peer_departed(2)
    with pytest.raises(PeerFailure) as refused:
        matcher.check_peer(2)
    assert refused.value is departed
    matcher.check_peer(3)
    matcher.close()
    with pytest.raises(GroupBrokenError, match="closed"):
        matcher.check_peer(3)


def test_an_aborted_send_or_receive_is_the_one_with_that_peer() -> None:
    """Sends and receives are numbered per peer: message 0 on a tag from rank 1 and from rank 2 share an
    ident, and an abort of the one leaves the other."""
    matcher, _ = _matcher()

    def receive(src: int) -> Recv:
        recv = Recv(Op(0, 4, 0, SIG, (src,), timedelta(seconds=10), "recv", str), src, 0,
                    memoryview(bytearray(16)), None, None)
        matcher.post(recv)
        return recv

    one, two = receive(1), receive(2)
    matcher.fail_op((0, 4, 0), CollectiveMismatchError("rank 1 sent something else"), 1)
    assert isinstance(one.error, CollectiveMismatchError) and not two.event.is_set()
    arrival = matcher.arrive(2, (0, 4, 0), 0, SIG, 16)
    arrival.view[:] = bytes(range(16))
    arrival.done()
    assert two.error is None and bytes(two.view) == bytes(range(16))
