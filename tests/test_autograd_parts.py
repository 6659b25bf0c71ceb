"""Distributed autograd's parts in one process: what a context records for messages, where
gradients are routed, which leaves a pass computes, and which contexts a dead worker ends."""

from __future__ import annotations

import torch

from shoal.autograd.engine import _leaves_reached
from shoal.autograd.registry import ContextRegistry, originator
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
