"""Distributed autograd's parts in one process: what a context records for messages, where
gradients are routed, which leaves a pass computes, where a pass's weight goes, and which
contexts a dead worker ends."""

from __future__ import annotations

import time
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from shoal.autograd import engine
from shoal.autograd.engine import _leaves_reached
from shoal.rpc import current
from shoal.rpc.autograd_contexts import ContextRegistry, originator
from shoal.rpc.headers import AutogradTag


def test_context_ids_carry_their_originator_and_are_unique() -> None:
    registry = ContextRegistry()
    registry.started(rank=5)
    ids = {registry.create(5).id for _ in range(100)}
    assert len(ids) == 100 and {originator(i) for i in ids} == {5}


def test_a_tensor_made_here_is_a_send_and_a_forwarded_one_keeps_its_origin() -> None:
    registry = ContextRegistry()
    registry.started(rank=0)
    context_id = registry.create(0).id
    received = torch.ones(2, requires_grad=True)
    registry.record_recv(1, AutogradTag(context_id, send_id=7), {3: received})  # from rank 1's send 7
    made = received * 2
    tag = registry.record_send(context_id, 2, {0: made, 1: received})
    assert tag.send_id is not None and tag.forwarded == ((1, 1, 7, 3),)
    context = registry.get(context_id)
    assert context.sent(tag.send_id, 0) is made and context.origin(received) == (1, 7, 3)
    assert context.origin(made) is None and context.workers() == {1, 2}

    # On the receiving side, the forwarded tensor's gradient goes to rank 1, not to rank 0.
    there = ContextRegistry()
    there.started(rank=2)
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    there.record_recv(0, tag, {0: a, 1: b})
    assert there.get(context_id).origin(a) == (0, tag.send_id, 0)
    assert there.get(context_id).origin(b) == (1, 7, 3)
    assert there.get(context_id).workers() == {0, 1}


def test_a_message_of_forwarded_tensors_only_records_no_send() -> None:
    registry = ContextRegistry()
    registry.started(rank=0)
    context_id = registry.create(0).id
    received = torch.ones(2, requires_grad=True)
    registry.record_recv(1, AutogradTag(context_id, send_id=4), {0: received})
    tag = registry.record_send(context_id, 2, {0: received})
    assert tag == AutogradTag(context_id, None, ((0, 1, 4, 0),))
    assert not registry.get(context_id).has_sends() and registry.get(context_id).workers() == {1, 2}


def test_a_dead_worker_ends_its_contexts_and_those_only_it_could_release() -> None:
    registry = ContextRegistry()
    registry.started(rank=0)
    mine = registry.create(0).id
    theirs = 2 << 48 | 5  # made by rank 2
    orphan = 1 << 48 | 9  # made by rank 1, known here through rank 2 only
    other = 1 << 48 | 10  # made by rank 1, which this worker also exchanged with
    for context_id, peers in ((mine, [2]), (theirs, [2]), (orphan, [2]), (other, [1, 2])):
        for peer in peers:
            registry.record_recv(peer, AutogradTag(context_id, 0), {0: torch.ones(1, requires_grad=True)})
    registry.peer_failed(2)
    assert {c for c in (mine, theirs, orphan, other) if _alive(registry, c)} == {mine, other}


def _alive(registry: ContextRegistry, context_id: int) -> bool:
    try:
        registry.get(context_id)
    except RuntimeError:
        return False
    return True


def test_a_pass_computes_gradients_for_every_leaf_reached_once() -> None:
    w, b = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    x = torch.ones(3)
    y = (w * x + b) * w  # w is reached twice, and is also an output itself
    reached = _leaves_reached([y, w])
    assert len(reached) == 2 and {id(t) for t in reached} == {id(w), id(b)}


@pytest.fixture
def notices(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Stand in for rank 2's agent: the notices a pass sends, as (worker, function, args)."""
    sent: list[tuple] = []
    agent = SimpleNamespace(rank=2, name="w2", notify=lambda to, func, args: sent.append((to, func, args)))
    monkeypatch.setattr(current, "_current", agent)
    return sent


def test_a_pass_splits_its_weight_among_the_workers_it_sends_gradients_to_and_returns_none(notices) -> None:
    context = ContextRegistry()
    context.started(rank=2)
    context_id = context.create(2).id
    from_0, from_1 = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    context.record_recv(0, AutogradTag(context_id, send_id=4), {0: from_0})
    context.record_recv(1, AutogradTag(context_id, send_id=9), {0: from_1})
    out = (from_0 * 3 + from_1 * 5).sum()
    engine.run_pass(context.get(context_id), [out], [torch.tensor(1.0)], False, (7, 11), Fraction(1, 3))
    assert sorted((to, func, args[3]) for to, func, args in notices) == [
        (0, engine.gradients_arrive, Fraction(1, 6)), (1, engine.gradients_arrive, Fraction(1, 6))]
    grads = {to: args[1] for to, _, args in notices}
    assert grads[0][0][:2] == (4, 0) and torch.equal(grads[0][0][2], torch.full((2,), 3.0))
    assert grads[1][0][:2] == (9, 0) and torch.equal(grads[1][0][2], torch.full((2,), 5.0))


def test_a_pass_that_sends_nothing_on_returns_its_whole_weight_to_the_originator(notices) -> None:
    context = ContextRegistry()
    context.started(rank=2)
    context_id = context.create(2).id
    w = torch.ones(2, requires_grad=True)
    engine.run_pass(context.get(context_id), [(w * 2).sum()], [torch.tensor(1.0)], False, (7, 11), Fraction(1, 3))
    assert notices == [(7, engine.weight_returned, (11, Fraction(1, 3), None))]
    assert torch.equal(context.get(context_id).gradients()[w], torch.full((2,), 2.0))


def test_gradients_from_another_worker_continue_on_the_passes_thread(notices, monkeypatch) -> None:
    registry = ContextRegistry()
    registry.started(rank=2)
    monkeypatch.setattr(engine, "contexts", registry)
    context_id = registry.create(2).id
    w = torch.ones(2, requires_grad=True)
    tag = registry.record_send(context_id, 0, {0: w * 3})  # sent to rank 0, whose gradient comes back
    engine.gradients_arrive(context_id, [(tag.send_id, 0, torch.ones(2))], (7, 11), Fraction(1, 2))
    registry.stopped(time.monotonic() + 10)  # waits for the pass
    assert notices == [(7, engine.weight_returned, (11, Fraction(1, 2), None))]
    assert torch.equal(registry.get(context_id).gradients()[w], torch.full((2,), 3.0))


def test_a_pass_that_cannot_be_queued_returns_its_weight_with_the_error(notices, monkeypatch) -> None:
    registry = ContextRegistry()
    registry.started(rank=2)
    registry.stopped(None)
    monkeypatch.setattr(engine, "contexts", registry)
    engine.gradients_arrive(123, [], (7, 11), Fraction(1, 2))
    [(to, func, (number, weight, packed))] = notices
    assert (to, func, number, weight) == (7, engine.weight_returned, 11, Fraction(1, 2))
    assert "shut down" in packed[2]
